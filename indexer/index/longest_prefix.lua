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
-- HMGETs of CHUNK blocks, or a quarter of the blocks read so far when that is more (up to
-- MAX_CHUNK), so what is read beyond the walk's end is less than CHUNK blocks or a
-- quarter of the walk. Why chunks: a command called from Lua has a fixed cost of about
-- four field reads, so one call per block spent most of the script in calls. A value's
-- records are passed over only where it differs from the block before (equal values are
-- one Lua string: comparing them is a pointer compare).
local wanted = ARGV[1]
local call, sub, byte, char, floor, min, max, unpack = redis.call, string.sub, string.byte,
  string.char, math.floor, math.min, math.max, unpack
local CHUNK, MAX_CHUNK = 32, 256
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

-- the runs so far and the last one as one string
local function finish(runs, value, count)
  if count > 0 then runs[#runs + 1] = head(count, #value) .. value end
  return table.concat(runs)
end

-- the group's runs as one string ('' : it holds nothing of the first block)
local function walk(holders)
  local runs, prev, count, alive = {}, nil, 0, nil
  local values, from = {call('HGET', holders, fields[1])}, 1
  while true do
    for j = 1, #values do
      local v = values[j]   -- false: the group does not hold the block
      if v ~= prev then
        local left, any = nil, false
        if v then left, any = still(v, alive) end
        if not any then return finish(runs, prev, count) end
        if count > 0 then runs[#runs + 1] = head(count, #prev) .. prev end
        alive, prev, count = left, v, 0
      end
      count = count + 1
    end
    from = from + #values
    if from > num_blocks then return finish(runs, prev, count) end
    local size = min(max(CHUNK, floor((from - 1) / 4)), MAX_CHUNK)
    local last = min(num_blocks, from + size - 1)
    fields_to(last)
    values = call('HMGET', holders, unpack(fields, from, last))
  end
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
