-- Apply one stream's batch atomically together with its watermark.
-- KEYS: meta, keys (block key -> 3 count bytes), hash (engine hash -> block key)
-- ARGV: seq, ts, ops: 18-byte records (kind u8, tier u8, engine hash 8B, key 8B)
-- Returns {applied (0/1), unknown removals, unresolved stores, fresh (0/1)}; fresh = the
-- stream had no watermark before this batch (new, cleared, dropped or lost in a restart),
-- so the caller must (re)register it in the streams set (another slot: not done here).
local meta, keys, hashes = KEYS[1], KEYS[2], KEYS[3]
local seq = tonumber(ARGV[1])
local stored_wm = redis.call('HGET', meta, 'wm')
local wm = tonumber(stored_wm or '-1')
if seq <= wm then return {0, 0, 0, 0} end
local fresh = stored_wm and 0 or 1

local delta = {0, 0, 0}
local unknown, unresolved = 0, 0

-- add d to a block's count on tier t (1-based); false if it would go below zero
local function bump(key, t, d)
  local v = redis.call('HGET', keys, key)
  local c = {0, 0, 0}
  if v then c[1], c[2], c[3] = string.byte(v, 1, 3) end
  local before = c[t]
  local after = before + d
  if after < 0 then return false, false end
  if after > 255 then after = 255 end
  c[t] = after
  if before == 0 and after > 0 then delta[t] = delta[t] + 1 end
  if before > 0 and after == 0 then delta[t] = delta[t] - 1 end
  if c[1] + c[2] + c[3] == 0 then
    redis.call('HDEL', keys, key)
    return true, true
  end
  redis.call('HSET', keys, key, string.char(c[1], c[2], c[3]))
  return true, false
end

local ops = ARGV[3]
for off = 1, #ops, 18 do
  local kind = string.byte(ops, off)
  local t = string.byte(ops, off + 1) + 1
  local eh = string.sub(ops, off + 2, off + 9)
  if kind == 0 then
    local key = string.sub(ops, off + 10, off + 17)
    redis.call('HSET', hashes, eh, key)
    bump(key, t, 1)
  elseif kind == 1 then
    local key = redis.call('HGET', hashes, eh)
    if key then bump(key, t, 1) else unresolved = unresolved + 1 end
  elseif kind == 2 then
    local key = redis.call('HGET', hashes, eh)
    if not key then
      unknown = unknown + 1
    else
      local ok, gone = bump(key, t, -1)
      if not ok then unknown = unknown + 1 elseif gone then redis.call('HDEL', hashes, eh) end
    end
  elseif kind == 3 then
    redis.call('DEL', keys, hashes)
    redis.call('HSET', meta, 'n0', 0, 'n1', 0, 'n2', 0)
    delta = {0, 0, 0}
  end
end

redis.call('HSET', meta, 'wm', ARGV[1], 'ts', ARGV[2])
for t = 1, 3 do
  if delta[t] ~= 0 then redis.call('HINCRBY', meta, 'n' .. (t - 1), delta[t]) end
end
return {1, unknown, unresolved, fresh}
