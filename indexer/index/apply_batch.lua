-- Apply consecutive batches of one stream, each atomically with the stream's watermark.
-- KEYS: meta, keys (block field -> packed tier counts), hash (engine hash -> block key)
-- ARGV: n, then n times: seq (a decimal integer, 0 <= seq < 2^64), ts, ops (18-byte records: kind u8, tier u8, engine hash 8B,
--       block key 8B big-endian; kinds 0 store, 1 store by hash, 2 remove, 3 clear),
--       then optionally the writer's lease token (sharded indexers; '' or absent: no fence)
-- The fence: meta's `owner` field names the indexer that owns the stream. A token that is
-- not the owner's applies nothing and returns {-1}; with no owner recorded (a new stream,
-- or one whose state was lost) the writer becomes the owner.
-- A block's field in `keys` is the low 6 bytes of its key (memory: see redis_schema.py);
-- its counts are one integer gpu + cpu * 2^16 + other * 2^32, so a store is one HINCRBY.
-- Engine-hash mappings are staged in a Lua table and written once at the end. (Staging the
-- counts too, with bulk HMGET/HSET, measured slower: Lua table and string work per block
-- cost more than the HINCRBY calls it saved.)
-- Returns n triples {applied 0/1, unknown removals, unresolved stores}, then fresh 0/1:
-- fresh = the stream had no watermark before (new, cleared, dropped or lost in a Redis
-- restart), so the caller must (re)list it in the streams set (another slot).
local meta, keys, hashes = KEYS[1], KEYS[2], KEYS[3]
local call, byte, sub, floor, unpack = redis.call, string.byte, string.sub, math.floor, unpack
local n = tonumber(ARGV[1])
local token = ARGV[2 + 3 * n]
if token and token ~= '' then
  local owner = call('HGET', meta, 'owner')
  if owner and owner ~= token then return {-1} end
  if not owner then call('HSET', meta, 'owner', token) end
end
local CHUNK = 2000
-- Seqs are compared as decimal strings left-padded to 20 digits, never as Lua numbers:
-- those are doubles, exact only below 2^53, and a seq may be any value below 2^64. The
-- watermark is stored as the seq's own decimal string; one that is not a decimal integer
-- (as a float written by older code) counts as no watermark and is overwritten.
local function padded(s)
  return string.rep('0', 20 - #s) .. s
end
local stored_wm = call('HGET', meta, 'wm')
local wm_text = nil
local wm = ''   -- below every padded seq
if stored_wm and string.find(stored_wm, '^%d+$') and #stored_wm <= 20 then
  wm = padded(stored_wm)
end
local fresh = stored_wm and 0 or 1
local UNIT = {1, 65536, 4294967296}
local delta = {0, 0, 0}
local staged = {}   -- engine hash -> block key (string) or false (deleted)
local out = {}
local last_ts = nil

local function count_of(v, t)
  return floor(v / UNIT[t]) % 65536
end

local function key_of(eh)
  local key = staged[eh]
  if key == nil then
    key = call('HGET', hashes, eh) or false
    staged[eh] = key
  end
  return key
end

local function store(key, t)
  local v = call('HINCRBY', keys, sub(key, 3, 8), UNIT[t])
  if count_of(v, t) == 1 then delta[t] = delta[t] + 1 end
end

-- false if the block is not held on tier t (nothing changes then)
local function remove(eh, t)
  local key = key_of(eh)
  if not key then return false end
  local field = sub(key, 3, 8)
  local v = call('HINCRBY', keys, field, -UNIT[t])
  if count_of(v + UNIT[t], t) == 0 then
    if call('HINCRBY', keys, field, UNIT[t]) == 0 then call('HDEL', keys, field) end
    return false
  end
  if count_of(v, t) == 0 then delta[t] = delta[t] - 1 end
  if v == 0 then
    call('HDEL', keys, field)
    staged[eh] = false
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
      local key = sub(ops, off + 10, off + 17)
      staged[eh] = key
      store(key, t)
    elseif kind == 1 then
      local key = key_of(eh)
      if key then store(key, t) else unresolved = unresolved + 1 end
    elseif kind == 2 then
      if not remove(eh, t) then unknown = unknown + 1 end
    elseif kind == 3 then
      call('DEL', keys, hashes)
      call('HSET', meta, 'n0', 0, 'n1', 0, 'n2', 0)
      delta = {0, 0, 0}
      staged = {}
    end
  end
  return unknown, unresolved
end

local function write_staged()
  local set, del = {}, {}
  for eh, key in pairs(staged) do
    if key then
      set[#set + 1] = eh
      set[#set + 1] = key
    else
      del[#del + 1] = eh
    end
  end
  for i = 1, #set, CHUNK do
    call('HSET', hashes, unpack(set, i, math.min(i + CHUNK - 1, #set)))
  end
  for i = 1, #del, CHUNK do
    call('HDEL', hashes, unpack(del, i, math.min(i + CHUNK - 1, #del)))
  end
end

for i = 0, n - 1 do
  local seq_text = ARGV[2 + 3 * i]
  local seq = padded(seq_text)
  if sub(seq_text, 1, 1) == '-' or seq <= wm then   -- a negative seq is below any watermark
    out[#out + 1] = 0; out[#out + 1] = 0; out[#out + 1] = 0
  else
    local unknown, unresolved = apply(ARGV[4 + 3 * i])
    wm = seq
    wm_text = seq_text
    last_ts = ARGV[3 + 3 * i]
    out[#out + 1] = 1; out[#out + 1] = unknown; out[#out + 1] = unresolved
  end
end

if last_ts then
  write_staged()
  call('HSET', meta, 'wm', wm_text, 'ts', last_ts)
  for t = 1, 3 do
    if delta[t] ~= 0 then call('HINCRBY', meta, 'n' .. (t - 1), delta[t]) end
  end
end
out[#out + 1] = fresh
return out
