-- Shared by every ledger script (reservations.py prepends it to each): the server's clock
-- in ms, and a lease's removal (its reservations taken off the totals, then the lease
-- forgotten). KEYS of every script start with the totals HASH and the leases ZSET; all of
-- them carry the hash tag {inflight}.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function subtract(totals, replica, tokens)
  if redis.call('HINCRBY', totals, replica, -1) <= 0 then
    redis.call('HDEL', totals, replica, replica .. '/tokens')
  else
    redis.call('HINCRBY', totals, replica .. '/tokens', -tokens)
  end
end
local function drop(totals, leases, lease, holder)
  local held = redis.call('HVALS', lease)
  for _, value in ipairs(held) do
    local sep = string.find(value, ' ', 1, true)
    subtract(totals, string.sub(value, 1, sep - 1), tonumber(string.sub(value, sep + 1)))
  end
  redis.call('DEL', lease)
  redis.call('ZREM', leases, holder)
  return #held
end
-- 1 when the holder's lease is live; a lapsed one is dropped (0), none is 0.
local function live(totals, leases, lease, holder, now)
  local expiry = tonumber(redis.call('ZSCORE', leases, holder))
  if not expiry then
    return 0
  end
  if expiry <= now then
    drop(totals, leases, lease, holder)
    return 0
  end
  return 1
end
