-- Argo CD health check for sparsegate.dev/RoutingPolicy (register as
-- resource.customizations.health.sparsegate.dev_RoutingPolicy in argocd-cm).
--   Stalled=True (OPA refused the policy or its data, or the compiled
--     allow-list does not fit: PolicyTooLarge)                         -> Degraded
--   Degraded=True (OPA unreachable: the last good allow-list is kept,
--     fail closed, retried without a spec change)                      -> Degraded
--   Ready=True (OPA holds this generation, decisions published)        -> Healthy
--   otherwise (not loaded in OPA yet)                                  -> Progressing
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
  hs.message = "Waiting for the sparsegate operator to load the policy into OPA"
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
  if c ~= nil and c.status == "True" then
    hs.status = "Degraded"
    hs.message = c.message
    return hs
  end
end
local ready = condition("Ready")
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message
  return hs
end
hs.status = "Progressing"
hs.message = (ready ~= nil and ready.message) or "Not loaded in OPA yet"
return hs
