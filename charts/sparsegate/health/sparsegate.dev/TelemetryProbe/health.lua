-- Argo CD health check for sparsegate.dev/TelemetryProbe (register as
-- resource.customizations.health.sparsegate.dev_TelemetryProbe in argocd-cm).
-- No sparsegate component writes TelemetryProbe status today (the node agent takes its
-- settings from its own flags), so a probe without status is Healthy: the same answer Argo CD
-- gives a custom resource that has no health check, and not Progressing forever. Should a
-- status with conditions appear, it is read the kstatus way:
--   Stalled=True -> Degraded, Reconciling=True -> Progressing, Ready=False -> Progressing,
--   Ready=True -> Healthy.
local hs = {}
if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Healthy"
  hs.message = "No controller reports TelemetryProbe status"
  return hs
end
if obj.metadata.generation ~= nil and obj.status.observedGeneration ~= nil
    and obj.status.observedGeneration < obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "Waiting for generation " .. tostring(obj.metadata.generation) .. " to be observed"
  return hs
end
hs.status = "Healthy"
hs.message = ""
for _, c in ipairs(obj.status.conditions) do
  if c.type == "Stalled" and c.status == "True" then
    hs.status = "Degraded"
    hs.message = c.message
    return hs
  end
  if c.type == "Reconciling" and c.status == "True" then
    hs.status = "Progressing"
    hs.message = c.message
  end
  if c.type == "Ready" and c.status ~= "True" and hs.status == "Healthy" then
    hs.status = "Progressing"
    hs.message = c.message
  end
end
return hs
