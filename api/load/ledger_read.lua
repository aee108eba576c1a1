-- KEYS: totals, leases. {0, lapsed holders} when some lease lapsed (the caller reaps them,
-- naming their keys, and reads again), else {1, the totals HASH: field, value, ...}: one
-- field per replica with requests in flight (and its tokens), whatever the fleet's size.
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now_ms(), 'LIMIT', 0, 64)
if #lapsed > 0 then
  return {0, lapsed}
end
return {1, redis.call('HGETALL', KEYS[1])}
