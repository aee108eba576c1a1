-- Longest run of leading keys each stream holds, stopping at that stream's first miss.
-- KEYS: one `keys` hash per stream (block field -> packed tier counts: gpu + cpu * 2^16 +
--       other * 2^32)
-- ARGV: the block keys, 8 bytes big-endian each; a block's field is its key's low 6 bytes
-- Returns, per stream in KEYS order, one byte per matched block: its best tier (0 GPU,
-- 1 CPU, 2 other).
-- Several streams per call on purpose: one EVALSHA per stream cost more than its HGETs
-- (each call copies ARGV into Lua), so the store sends a few streams per call. On Redis
-- Cluster the streams of one call must share a slot; the store then sends one per call.
local wanted = ARGV[1]
local call, sub, floor, concat = redis.call, string.sub, math.floor, table.concat
local unpack, min = unpack, math.min
local num_keys = #wanted / 8
local MAX_READ = 256

local function tier_byte(v)
  if v == '1' then return '\0' end  -- the common case: held once, on GPU
  v = tonumber(v)
  if v % 65536 > 0 then return '\0' end
  if floor(v / 65536) % 65536 > 0 then return '\1' end
  return '\2'
end

-- Reads 1, 2, 4, ... blocks per HMGET (at most MAX_READ): a stream that holds n blocks
-- costs about log2(n) calls and under 2n field reads, one that holds none one read.
local function walk(hash)
  local out = {}
  local done, step = 0, 1
  while done < num_keys do
    local last = min(done + step, num_keys)
    local fields = {}
    for j = done, last - 1 do
      fields[#fields + 1] = sub(wanted, 8 * j + 3, 8 * j + 8)
    end
    local values = call('HMGET', hash, unpack(fields))
    for j = 1, #fields do
      local v = values[j]
      if not v then return concat(out) end
      out[#out + 1] = tier_byte(v)
    end
    done = last
    step = min(step * 2, MAX_READ)
  end
  return concat(out)
end

local result = {}
for i = 1, #KEYS do
  result[i] = walk(KEYS[i])
end
return result
