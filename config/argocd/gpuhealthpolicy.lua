-- Argo CD health of a GpuHealthPolicy: is the policy doing its job?
-- Nodes in remediation or Failed are the fleet's state, not the policy's:
-- they are in the message (and in gpuhealth's alerts), not in the health.
local hs = {}
local status = obj.status
if status == nil or status.observedGeneration == nil
    or status.observedGeneration < obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "Waiting for gpuhealth to read this generation of the policy"
  return hs
end

local function condition(type)
  if status.conditions ~= nil then
    for _, c in ipairs(status.conditions) do
      if c.type == type then
        return c
      end
    end
  end
  return nil
end

local ready = condition("Ready")
if ready ~= nil and ready.status == "False" then
  hs.status = "Degraded"
  hs.message = ready.message
  return hs
end
-- In order: an open circuit is said first.
for _, check in ipairs({{"CircuitOpen", "Circuit open: "}, {"Conflict", ""}}) do
  local type, prefix = check[1], check[2]
  local c = condition(type)
  if c ~= nil and c.status == "True" then
    hs.status = "Degraded"
    hs.message = prefix .. c.message
    return hs
  end
end

local counts = string.format("%d nodes: %d healthy, %d remediating, %d failed",
  status.nodes or 0, status.healthy or 0, status.remediating or 0, status.failed or 0)
local mode = obj.spec.mode or "Enforce"
if mode == "Paused" then
  hs.status = "Suspended"
  hs.message = "Paused: observing only; " .. counts
  return hs
end
hs.status = "Healthy"
if mode == "DryRun" then
  hs.message = "DryRun: recording plans, changing nothing; " .. counts
else
  hs.message = counts
end
return hs
