-- ARGV: token, the reader's epoch ('' none), its seq, then one replica per answer to count.
-- Returns {epoch, seq, 1, HGETALL} (read everything) or {epoch, seq, 0, {replica, load,
-- count, ...} of the replicas changed after the reader's seq, the replicas removed after it}.
if #ARGV > 3 then
  open_log()
  for i = 4, #ARGV do
    -- an unreadable count fails its HINCRBY alone: it reads as 0 until a newer load
    redis.pcall('HINCRBY', KEYS[1], ARGV[i] .. ANSWERS, 1)
    changed(ARGV[i])
  end
end
local meta = redis.call('HMGET', KEYS[1], EPOCH, SEQ, TRIMMED)
local epoch, seq, known = meta[1] or '', tonumber(meta[2]) or 0, tonumber(ARGV[3])
if epoch ~= ARGV[2] or known > seq or known < (tonumber(meta[3]) or 0) then
  return {epoch, seq, 1, redis.call('HGETALL', KEYS[1])}
end
if known == seq then
  return {epoch, seq, 0, {}, {}}
end
local replicas = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. ARGV[3], '+inf')
if #replicas > 64 and #replicas * 4 > redis.call('HLEN', KEYS[1]) then
  return {epoch, seq, 1, redis.call('HGETALL', KEYS[1])}  -- most of it: one whole read
end
local out = {}
for first = 1, #replicas, 500 do
  local last = math.min(first + 499, #replicas)
  local fields = {}
  for i = first, last do
    fields[#fields + 1] = replicas[i]
    fields[#fields + 1] = replicas[i] .. ANSWERS
  end
  local values = redis.call('HMGET', KEYS[1], unpack(fields))
  for i = first, last do
    local j = 2 * (i - first)
    out[#out + 1] = replicas[i]
    out[#out + 1] = values[j + 1]
    out[#out + 1] = values[j + 2]
  end
end
return {epoch, seq, 0, out, redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. ARGV[3], '+inf')}
