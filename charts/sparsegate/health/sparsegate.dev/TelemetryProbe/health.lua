-- Argo CD health check for sparsegate.dev/TelemetryProbe (register as
-- resource.customizations.health.sparsegate.dev_TelemetryProbe in argocd-cm).
-- The operator writes the status from the node agents' reports (kstatus conditions):
--   no status yet (the operator has not seen the probe)                    -> Progressing
--   generation not observed yet                                            -> Progressing
--   Stalled=True (xdpMode conflict with an older probe, or an agent's
--     attach error; the message names node, interface and error)          -> Degraded
--   Reconciling=True / Ready=False (agents not reported yet)               -> Progressing
--   Ready=True (attached on every selected node, or none selected)        -> Healthy
local hs = {}
if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the sparsegate operator to report the probe"
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
  if c.type == "Ready" and c.status == "True" and hs.message == "" then
    hs.message = c.message or ""  -- "attached on N node(s)", as the other kinds report Ready's message
  end
end
return hs
