-- Longest run of leading keys one stream holds, stopping at the first miss.
-- KEYS: keys (block key -> packed tier counts: gpu + cpu * 2^16 + other * 2^32)
-- ARGV: concatenated 8-byte block keys
-- Returns one byte per matched block: its best tier (0 GPU, 1 CPU, 2 other).
local keys = KEYS[1]
local wanted = ARGV[1]
local out = {}
for off = 1, #wanted, 8 do
  local v = redis.call('HGET', keys, string.sub(wanted, off, off + 7))
  if not v then break end
  v = tonumber(v)
  if v % 65536 > 0 then
    out[#out + 1] = '\0'
  elseif math.floor(v / 65536) % 65536 > 0 then
    out[#out + 1] = '\1'
  else
    out[#out + 1] = '\2'
  end
end
return table.concat(out)
