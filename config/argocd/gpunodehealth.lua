-- Argo CD health of a GpuNodeHealth: where its node is on the way from
-- the first signal back to serving.
local hs = {}
local status = obj.status
if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for gpuhealth to take the node in"
  return hs
end

local function describe()
  local text = status.phase
  if status.reason ~= nil and status.reason ~= "" then
    text = text .. " (" .. status.reason .. ")"
  end
  if status.message ~= nil and status.message ~= "" then
    text = text .. ": " .. status.message
  end
  return text
end

if status.phase == "Healthy" then
  hs.status = "Healthy"
elseif status.phase == "Failed" then
  -- Cordoned for a person: escalation exhausted, drain timed out, or a
  -- GPU that keeps failing.
  hs.status = "Degraded"
else
  hs.status = "Progressing"
end
hs.message = describe()
return hs
