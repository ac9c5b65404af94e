-- concurrency: at most `limit` requests in flight. Each admitted request holds a
-- lease: a member (its request id) of a sorted set, scored by the time the lease
-- expires. The request's permit removes it when the response ends (ZREM, tried
-- again with backoff if it fails; also sent after a call that failed on the client,
-- which may have run here all the same); the lease of an instance that died expires
-- after `lease` µs (a live instance renews its leases while the request runs:
-- redis.rs RENEW). Expired leases are not counted,
-- and are removed when a request is admitted. Each request takes one slot (config
-- validation rejects another cost). A refused request is told to retry in 1 s
-- (algo.rs: CONCURRENCY_RETRY_US).
local CONCURRENCY_RETRY = 1000000

local function concurrency(key, now, cost, limit, lease, _, _, uid)
  local count = redis.call('ZCOUNT', key, '(' .. int(now), '+inf')
  local after = count + cost
  if after > limit then
    return false, unsigned(limit - count), CONCURRENCY_RETRY, CONCURRENCY_RETRY, 0
  end
  return true, limit - after, 0, 0, 0, function()
    redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now))
    local expires_at = now + lease
    redis.call('ZADD', key, int(expires_at), uid)
    -- A lease taken under a longer `lease` (before a reload) keeps the key alive.
    local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    redis.call('PEXPIRE', key, ttl_ms(max(expires_at, tonumber(last[2]) or expires_at), now))
  end
end
