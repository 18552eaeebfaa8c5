-- Argo CD health check for sparsegate.dev/SparseModel (register as
-- resource.customizations.health.sparsegate.dev_SparseModel in argocd-cm).
--   Stalled=True or Degraded=True (GateConfig missing or invalid, apply refused;
--     pods that cannot run: CrashLoopBackOff, ImagePullBackOff, ..., named in the
--     message; the Deployment past its progress deadline)                      -> Degraded
--   Reconciling=True (instances starting or rolling, or the model's Service not
--     applied yet; Degraded ApplyRetrying: an apply the API server failed in
--     passing, 5xx/429/conflict/timeout, which the operator retries)            -> Progressing
--   Ready=True (every desired instance ready and updated)                       -> Healthy
local hs = {}
local function condition(kind)
  if obj.status ~= nil and obj.status.conditions ~= nil then
    for _, c in ipairs(obj.status.conditions) do
      if c.type == kind then
        return c
      end
    end
  end
  return nil
end

if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the sparsegate operator to report status"
  return hs
end
if obj.metadata.generation ~= nil and obj.status.observedGeneration ~= nil
    and obj.status.observedGeneration < obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(obj.metadata.generation)
  return hs
end
for _, kind in ipairs({"Stalled", "Degraded"}) do
  local c = condition(kind)
  if c ~= nil and c.status == "True" and c.reason ~= "ApplyRetrying" then
    hs.status = "Degraded"
    hs.message = c.message
    return hs
  end
end
local degraded = condition("Degraded")
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Progressing"
  hs.message = degraded.message
  return hs
end
local ready = condition("Ready")
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message
  return hs
end
hs.status = "Progressing"
hs.message = (ready ~= nil and ready.message) or "Waiting for instances"
return hs
