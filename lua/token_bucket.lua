-- token_bucket: `burst` tokens refilled continuously at N per P µs; starts full.
-- Tokens are scaled by P (one token = P units) so one µs refills exactly N units:
-- capacity C = burst * P. The level goes negative while delayed requests have
-- booked future tokens. State: a hash {t = tokens, ts = time they were counted}.
local function token_bucket(key, now, cost, n, p, burst, max_delay)
  n = math.max(n, 1)
  p = math.max(p, 1)
  local cap = burst * p
  local stored, ts = cap, now
  local s = redis.call('HMGET', key, 't', 'ts')
  if s[1] then
    stored, ts = tonumber(s[1]), tonumber(s[2]) or now
  end
  -- Refill: full if tokens >= C or elapsed >= ceil((C - tokens) / N).
  local elapsed = math.max(now - ts, 0)
  local tokens = cap
  if stored < cap and elapsed < ceil_div(cap - stored, n) then
    tokens = stored + elapsed * n
  end
  local after = tokens - cost * p
  local wait = 0
  if after < 0 then
    wait = ceil_div(-after, n)
  end
  -- Delay mode: book the tokens now (the level goes negative) and wait.
  local allowed, delay = admit_after(wait, max_delay)
  local level = tokens
  if allowed then
    level = after
  end
  local remaining = floor_div(math.max(level, 0), p)
  local reset = ceil_div(cap - level, n)
  if not allowed then
    return {false, remaining, reset, wait, 0}
  end
  return {true, remaining, reset, 0, delay}, function()
    redis.call('HSET', key, 't', int(after), 'ts', int(now))
    return now + ceil_div(cap - after, n)
  end
end
