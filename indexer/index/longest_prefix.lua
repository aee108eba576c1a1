-- Groups' holders of the prompt's leading blocks, each walked once (redis_schema.py).
-- KEYS: per group, its holders (block field -> holder records) and members (stream ->
--       number; #gen, #groups). Several groups per call on standalone Redis (one call
--       copies the prompt into Lua once); on a cluster one (a call's keys share a slot).
-- ARGV[1]: the block keys, 8 bytes big-endian each (a block's field is its low 6 bytes);
-- ARGV[1 + i]: the #gen the caller's numbering of the i-th group is from.
-- Returns per group {#gen, #groups, roster, runs}, or {} when the group holds nothing of
-- the first block (its members are not read then). roster is the members hash (HGETALL)
-- when #gen is not the caller's, else empty; runs is one string, per run a u32 count, a
-- u32 length and a value (big-endian): `count` consecutive blocks whose holder records
-- are all `value`. A group's walk stops at the first block that no stream holding every
-- block before it holds (a stream leaves the set still matching at its first miss), so it
-- reads the group's longest match, the block after it and the rest of the chunk that
-- block is in: an HGET of the first block (all a group holding none of it costs), then
-- HMGETs of FIRST_CHUNK blocks, each chunk half as long again as the one before up to
-- MAX_CHUNK (what is read beyond the walk's end is less than the last chunk, itself at
-- most about as long as everything read before it). Why chunks: a
-- command called from Lua costs about what four field reads do, and a field read is
-- mostly the hash lookup's memory accesses, whoever holds it. A value's records are
-- passed over only where it differs from the block before (equal values are one Lua
-- string: comparing them is a pointer compare).
local wanted = ARGV[1]
local call, sub, byte, char, floor, min, unpack = redis.call, string.sub, string.byte,
  string.char, math.floor, math.min, unpack
local FIRST_CHUNK, MAX_CHUNK = 16, 256
local num_blocks = #wanted / 8
local fields = {}   -- block i -> its field: made once per call, for every group

local function fields_to(last)
  for i = #fields + 1, last do
    local off = i * 8 - 5
    fields[i] = sub(wanted, off, off + 5)
  end
end

-- a run's head: its count and its value's length, u32 big-endian each
local function head(count, length)
  return char(floor(count / 16777216) % 256, floor(count / 65536) % 256,
              floor(count / 256) % 256, count % 256, floor(length / 16777216) % 256,
              floor(length / 65536) % 256, floor(length / 256) % 256, length % 256)
end

-- the holders in v that are in `alive` (every one when alive is nil), and whether any is
local function still(v, alive)
  local left, any = {}, false
  local i, n = 1, #v
  while i <= n do
    local h = byte(v, i) * 256 + byte(v, i + 1)
    local num = floor(h / 4)
    if alive == nil or alive[num] then
      left[num] = true
      any = true
    end
    i = i + ((h % 4 == 3) and 8 or 2)
  end
  return left, any
end

-- runs of one chunk of values onto `state` (runs, prev, count, alive); true at the walk's end
local function take(state, values)
  for j = 1, #values do
    local v = values[j]
    if not v then return true end
    if v == state.prev then
      state.count = state.count + 1
    else
      local left, any = still(v, state.alive)
      if not any then return true end
      if state.count > 0 then
        state.runs[#state.runs + 1] = head(state.count, #state.prev) .. state.prev
      end
      state.alive, state.prev, state.count = left, v, 1
    end
  end
  return false
end

-- the group's runs as one string ('' : it holds nothing of the first block)
local function walk(holders)
  local first = call('HGET', holders, fields[1])
  if not first then return '' end
  local state = {runs = {}, prev = nil, count = 0, alive = nil}
  local ended, from, size = take(state, {first}), 2, FIRST_CHUNK
  while not ended and from <= num_blocks do
    local last = min(num_blocks, from + size - 1)
    fields_to(last)
    ended = take(state, call('HMGET', holders, unpack(fields, from, last)))
    from, size = last + 1, min(size + floor(size / 2), MAX_CHUNK)
  end
  state.runs[#state.runs + 1] = head(state.count, #state.prev) .. state.prev
  return table.concat(state.runs)
end

local out = {}
fields_to(1)
for i = 1, #KEYS, 2 do
  local runs = walk(KEYS[i])
  if runs == '' then
    out[#out + 1] = {}
  else
    local members = KEYS[i + 1]
    local top = call('HMGET', members, '#gen', '#groups')
    local gen = top[1] or '0'
    local roster = {}
    if gen ~= ARGV[1 + (i + 1) / 2] then roster = call('HGETALL', members) end
    out[#out + 1] = {gen, top[2] or '', roster, runs}
  end
end
return out
