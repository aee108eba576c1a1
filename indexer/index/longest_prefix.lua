-- Groups' holders of the prompt's leading blocks, each walked once (redis_schema.py).
-- KEYS: per group, its holders (block field -> holder records) and members (stream ->
--       number; #gen, #groups). Several groups per call on standalone Redis (one call
--       copies the prompt into Lua once); on a cluster one (a call's keys share a slot).
-- ARGV[1]: the block keys, 8 bytes big-endian each (a block's field is its low 6 bytes);
-- ARGV[1 + i]: the #gen the caller's numbering of the i-th group is from.
-- Returns per group {#gen, #groups, roster, runs}: roster is the members hash (HGETALL)
-- when #gen is not the caller's, else empty; runs is {count, value, count, value, ...}:
-- `count` consecutive blocks whose holder records are all `value`. A group's walk stops at
-- the first block that no stream holding every block before it holds (a stream leaves the
-- set still matching at its first miss), so it costs the group's longest match plus one
-- read: one HGET a block, and a pass over a value's records only where it differs from
-- the block before.
local wanted = ARGV[1]
local call, sub, byte, floor = redis.call, string.sub, string.byte, math.floor

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

local function walk(holders)
  local runs, prev, count, alive = {}, nil, 0, nil
  for off = 3, #wanted, 8 do
    local v = call('HGET', holders, sub(wanted, off, off + 5))
    if not v then break end
    if v == prev then
      count = count + 1
    else
      local left, any = still(v, alive)
      if not any then break end
      if count > 0 then
        runs[#runs + 1] = count
        runs[#runs + 1] = prev
      end
      alive, prev, count = left, v, 1
    end
  end
  if count > 0 then
    runs[#runs + 1] = count
    runs[#runs + 1] = prev
  end
  return runs
end

local out = {}
for i = 1, #KEYS, 2 do
  local members = KEYS[i + 1]
  local top = call('HMGET', members, '#gen', '#groups')
  local gen = top[1] or '0'
  local roster = {}
  if gen ~= ARGV[1 + (i + 1) / 2] then roster = call('HGETALL', members) end
  out[#out + 1] = {gen, top[2] or '', roster, walk(KEYS[i])}
end
return out
