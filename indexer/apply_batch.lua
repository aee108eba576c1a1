-- Apply consecutive batches of one stream, each atomically with the stream's watermark.
-- KEYS: meta, keys (block key -> packed tier counts), hash (engine hash -> block key)
-- ARGV: n, then n times: seq, ts, ops (18-byte records: kind u8, tier u8, engine hash 8B,
--       block key 8B; kinds 0 store, 1 store by hash, 2 remove, 3 clear)
-- A block's counts are one integer: gpu + cpu * 2^16 + other * 2^32 (HINCRBY-able).
-- Returns n triples {applied 0/1, unknown removals, unresolved stores}, then fresh 0/1:
-- fresh = the stream had no watermark before (new, cleared, dropped or lost in a Redis
-- restart), so the caller must (re)list it in the streams set (another slot).
local meta, keys, hashes = KEYS[1], KEYS[2], KEYS[3]
local call, byte, sub, floor = redis.call, string.byte, string.sub, math.floor
local stored_wm = call('HGET', meta, 'wm')
local wm = tonumber(stored_wm or '-1')
local fresh = stored_wm and 0 or 1
local UNIT = {1, 65536, 4294967296}
local delta = {0, 0, 0}
local out = {}
local last_ts = nil

local function count_of(v, t)
  return floor(v / UNIT[t]) % 65536
end

local function store(eh, key, t)
  if eh then call('HSET', hashes, eh, key) end
  local v = call('HINCRBY', keys, key, UNIT[t])
  if count_of(v, t) == 1 then delta[t] = delta[t] + 1 end
end

-- returns false if the block is not held on tier t (nothing changes then)
local function remove(eh, t)
  local key = call('HGET', hashes, eh)
  if not key then return false end
  local v = call('HINCRBY', keys, key, -UNIT[t])
  if count_of(v + UNIT[t], t) == 0 then
    if call('HINCRBY', keys, key, UNIT[t]) == 0 then call('HDEL', keys, key) end
    return false
  end
  if count_of(v, t) == 0 then delta[t] = delta[t] - 1 end
  if v == 0 then
    call('HDEL', keys, key)
    call('HDEL', hashes, eh)
  end
  return true
end

local function apply(ops)
  local unknown, unresolved = 0, 0
  for off = 1, #ops, 18 do
    local kind = byte(ops, off)
    local t = byte(ops, off + 1) + 1
    local eh = sub(ops, off + 2, off + 9)
    if kind == 0 then
      store(eh, sub(ops, off + 10, off + 17), t)
    elseif kind == 1 then
      local key = call('HGET', hashes, eh)
      if key then store(nil, key, t) else unresolved = unresolved + 1 end
    elseif kind == 2 then
      if not remove(eh, t) then unknown = unknown + 1 end
    elseif kind == 3 then
      call('DEL', keys, hashes)
      call('HSET', meta, 'n0', 0, 'n1', 0, 'n2', 0)
      delta = {0, 0, 0}
    end
  end
  return unknown, unresolved
end

local n = tonumber(ARGV[1])
for i = 0, n - 1 do
  local seq = tonumber(ARGV[2 + 3 * i])
  if seq <= wm then
    out[#out + 1] = 0; out[#out + 1] = 0; out[#out + 1] = 0
  else
    local unknown, unresolved = apply(ARGV[4 + 3 * i])
    wm = seq
    last_ts = ARGV[3 + 3 * i]
    out[#out + 1] = 1; out[#out + 1] = unknown; out[#out + 1] = unresolved
  end
end

if last_ts then
  call('HSET', meta, 'wm', wm, 'ts', last_ts)
  for t = 1, 3 do
    if delta[t] ~= 0 then call('HINCRBY', meta, 'n' .. (t - 1), delta[t]) end
  end
end
out[#out + 1] = fresh
return out
