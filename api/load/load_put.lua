-- ARGV: token, replica, ts of the new load, the new load (JSON). 1 when stored, 0 when the
-- stored load is newer. An undecodable stored value counts as older: it is overwritten
-- rather than blocking the replica forever.
local old = redis.call('HGET', KEYS[1], ARGV[2])
local newer = true
if old then
  local ok, decoded = pcall(cjson.decode, old)
  if ok and type(decoded) == 'table' then
    local old_ts = tonumber(decoded['ts'])
    if old_ts and old_ts > tonumber(ARGV[3]) then
      return 0
    end
    newer = not (old_ts and old_ts == tonumber(ARGV[3]))
  end
end
open_log()
redis.call('HSET', KEYS[1], ARGV[2], ARGV[4])
if newer then
  redis.call('HDEL', KEYS[1], ARGV[2] .. ANSWERS)  -- a new measurement: its answers from 0
end
changed(ARGV[2])
return 1
