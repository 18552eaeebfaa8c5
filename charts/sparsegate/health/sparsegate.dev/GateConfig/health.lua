-- Argo CD health check for sparsegate.dev/GateConfig (register as
-- resource.customizations.health.sparsegate.dev_GateConfig in argocd-cm).
-- Reads what the operator writes: status.observedGeneration, the kstatus conditions
-- (Ready, Reconciling, Stalled) and status.rollout.phase.
--   Paused                                   -> Suspended (not Progressing forever)
--   Stalled=True (rolled back or aborted while the spec still names that version,
--     invalid spec, failed analysis with autoRollback off, pods refusing the gate
--     document: StableChecksumMismatch, CanaryChecksumMismatch, GatePushRefused)  -> Degraded
--   Reconciling=True (pushing, analysing, rolling back)     -> Progressing
--   Ready=True                                              -> Healthy
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

if obj.status == nil then
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
local rollout = obj.status.rollout or {}
if rollout.phase == "Paused" then
  hs.status = "Suspended"
  hs.message = rollout.message or "Rollout paused (spec.rollout.paused)"
  return hs
end
local stalled = condition("Stalled")
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = stalled.message
  return hs
end
local reconciling = condition("Reconciling")
if reconciling ~= nil and reconciling.status == "True" then
  hs.status = "Progressing"
  hs.message = reconciling.message
  return hs
end
local ready = condition("Ready")
if ready ~= nil then
  if ready.status == "True" then
    hs.status = "Healthy"
  else
    hs.status = "Progressing"
  end
  hs.message = ready.message
  return hs
end
-- Status written by an operator without the kstatus conditions: judge by phase alone.
if rollout.phase == "Succeeded" then
  hs.status = "Healthy"
elseif rollout.phase == "Failed" or rollout.phase == "RolledBack" or rollout.phase == "Aborted" then
  hs.status = "Degraded"
else
  hs.status = "Progressing"
end
hs.message = rollout.message or ""
return hs
