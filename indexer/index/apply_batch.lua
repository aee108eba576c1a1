-- Apply consecutive batches of one stream, each atomically with the stream's watermark.
-- (holders.lua is prepended: the holder records and `forget`.)
-- KEYS: meta, hash (engine hash -> block key), lost, holders (the group's block field ->
--       holder records), members (the group's stream -> number): one hash tag, one slot
-- ARGV: n, then n times: seq (a decimal integer, 0 <= seq < 2^64), ts, ops (18-byte records:
--       kind u8, tier u8, engine hash 8B, block key 8B big-endian; kinds 0 store, 1 store
--       by hash, 2 remove, 3 clear), then the stream's name, the process's number of
--       groups, and optionally the writer's lease token (sharded indexers; '' or absent:
--       no fence)
-- The fence: meta's `owner` field names the indexer that owns the stream. A token that is
-- not the owner's applies nothing and returns {-1}; with no owner recorded (a new stream,
-- or one whose state was lost) the writer becomes the owner. A group written with another
-- number of groups returns {-2, its number} (nothing applied).
-- The stream gets its number in the group at its first store (a freed one first).
-- A block's field is the low 6 bytes of its key (redis_schema.py). A store of a block the
-- group does not hold is one HSETNX; other holder values and the engine-hash mappings are
-- staged in Lua tables and written once at the end (such a block's value is read once per
-- call, and written once, however many ops touch it).
-- An engine hash stored again with another key leaves the old key possibly held and named
-- by no mapping: it goes to `lost`, so a clear still finds it (read with one HMGET at the
-- end for the hashes not read before).
-- Returns n triples {applied 0/1, unknown removals, unresolved stores}, then fresh 0/1:
-- fresh = the stream had no watermark before (new, cleared, dropped or lost in a Redis
-- restart), so the caller must (re)list it in the streams set (another slot).
local meta, hashes, lost, holders, members = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local call, unpack, min = redis.call, unpack, math.min
local n = tonumber(ARGV[1])
local name, groups, token = ARGV[2 + 3 * n], ARGV[3 + 3 * n], ARGV[4 + 3 * n]
local member = call('HMGET', members, name, '#groups')
if member[2] and member[2] ~= groups then return {-2, member[2]} end
local head = call('HMGET', meta, 'wm', 'owner')
if token and token ~= '' then
  local owner = head[2]
  if owner and owner ~= token then return {-1} end
  if not owner then call('HSET', meta, 'owner', token) end
end
local CHUNK = 2000
local MAX_STREAMS = 16384
local number = member[1] and tonumber(member[1])

local function mine()
  if number then return number end
  local top = call('HMGET', members, '#free', '#next')
  local free = top[1]
  if free and #free >= 2 then
    number = byte(free, 1) * 256 + byte(free, 2)
    call('HSET', members, '#free', sub(free, 3))
  else
    number = tonumber(top[2] or '0')
    if number >= MAX_STREAMS then
      return error('kvindex: index group full (' .. MAX_STREAMS .. ' streams)')
    end
    call('HSET', members, '#next', number + 1)
  end
  call('HSET', members, name, number, '#groups', groups)
  bump_gen(members)
  return number
end

-- Seqs are compared as decimal strings left-padded to 20 digits, never as Lua numbers:
-- those are doubles, exact only below 2^53, and a seq may be any value below 2^64. The
-- watermark is stored as the seq's own decimal string; one that is not a decimal integer
-- (as a float written by older code) counts as no watermark and is overwritten.
local function padded(s)
  return string.rep('0', 20 - #s) .. s
end
local stored_wm = head[1]
local wm_text = nil
local wm = ''   -- below every padded seq
if stored_wm and string.find(stored_wm, '^%d+$') and #stored_wm <= 20 then
  wm = padded(stored_wm)
end
local fresh = stored_wm and 0 or 1
local delta = {0, 0, 0}
local staged = {}   -- engine hash -> block key (string) or false (deleted)
local unread = {}   -- engine hashes stored without their old mapping read
local values = {}   -- block field -> holder records ('' = none)
local lost_keys = {}
local out = {}
local last_ts = nil

local function value_of(field)
  local v = values[field]
  if v == nil then
    v = call('HGET', holders, field) or ''
    values[field] = v
  end
  return v
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
  local field = sub(key, 3, 8)
  local v = values[field]
  if v == nil then
    -- Not met yet in this call: a block no stream of the group holds (the common store)
    -- is written at once, one call, and not staged (a later op reads it back).
    if call('HSETNX', holders, field, single(mine(), t)) == 1 then
      delta[t] = delta[t] + 1
      return
    end
    v = value_of(field)
  end
  local before
  v, before = bump(v, mine(), t, 1)
  values[field] = v
  if before == 0 then delta[t] = delta[t] + 1 end
end

-- false if the block is not held on tier t (nothing changes then)
local function remove(eh, t)
  local key = key_of(eh)
  if not key or not number then return false end
  local field = sub(key, 3, 8)
  local v, before, held = bump(value_of(field), number, t, -1)
  if before == 0 then return false end
  values[field] = v
  if before == 1 then delta[t] = delta[t] - 1 end
  if not held then staged[eh] = false end
  return true
end

local function remap(eh, key)
  local old = staged[eh]
  if old == nil then
    unread[#unread + 1] = eh
  elseif old and old ~= key then
    lost_keys[#lost_keys + 1] = old
  end
  staged[eh] = key
end

local function in_chunks(command, key, list)
  for i = 1, #list, CHUNK do
    call(command, key, unpack(list, i, min(i + CHUNK - 1, #list)))
  end
end

local function find_lost()
  for i = 1, #unread, CHUNK do
    local part = {unpack(unread, i, min(i + CHUNK - 1, #unread))}
    local old = call('HMGET', hashes, unpack(part))
    for j = 1, #part do
      if old[j] and old[j] ~= staged[part[j]] then lost_keys[#lost_keys + 1] = old[j] end
    end
  end
  in_chunks('SADD', lost, lost_keys)
end

local function flush()
  find_lost()
  local set, del = {}, {}
  for eh, key in pairs(staged) do
    if key then
      set[#set + 1] = eh
      set[#set + 1] = key
    else
      del[#del + 1] = eh
    end
  end
  in_chunks('HSET', hashes, set)
  in_chunks('HDEL', hashes, del)
  set, del = {}, {}
  for field, v in pairs(values) do
    if v ~= '' then
      set[#set + 1] = field
      set[#set + 1] = v
    else
      del[#del + 1] = field
    end
  end
  in_chunks('HSET', holders, set)
  in_chunks('HDEL', holders, del)
  staged, unread, values, lost_keys = {}, {}, {}, {}
end

local function clear()
  flush()
  if number then forget(holders, hashes, lost, number) end
  call('HSET', meta, 'n0', 0, 'n1', 0, 'n2', 0)
  delta = {0, 0, 0}
end

local function apply(ops)
  local unknown, unresolved = 0, 0
  for off = 1, #ops, 18 do
    local kind = byte(ops, off)
    local t = byte(ops, off + 1) + 1
    local eh = sub(ops, off + 2, off + 9)
    if kind == 0 then
      local key = sub(ops, off + 10, off + 17)
      remap(eh, key)
      store(key, t)
    elseif kind == 1 then
      local key = key_of(eh)
      if key then store(key, t) else unresolved = unresolved + 1 end
    elseif kind == 2 then
      if not remove(eh, t) then unknown = unknown + 1 end
    elseif kind == 3 then
      clear()
    end
  end
  return unknown, unresolved
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
  flush()
  call('HSET', meta, 'wm', wm_text, 'ts', last_ts)
  for t = 1, 3 do
    if delta[t] ~= 0 then call('HINCRBY', meta, 'n' .. (t - 1), delta[t]) end
  end
end
out[#out + 1] = fresh
return out
