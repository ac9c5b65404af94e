-- token_bucket: `burst` tokens refilled continuously at N per P µs; starts full.
-- Tokens are scaled by P (one token = P units) so one µs refills exactly N units:
-- capacity C = burst * P. The level goes negative while delayed requests have
-- booked future tokens. State: a string "<tokens> <time they were counted> <n> <p>
-- <burst>", the last three the rate and burst they were counted under.

-- When a bucket at `tokens` units at `ts` is full under (n, p, burst)
-- (algo.rs: bucket_full_at).
local function bucket_full_at(tokens, ts, n, p, burst)
  return ts + ceil_div(burst * max(p, 1) - tokens, max(n, 1))
end

-- A level counted under (n0, p0, b0), read under (n, p, burst) at now: the level in
-- units of p and when it is as good as empty (math.huge: not before it is full), or
-- nil when it already is: full under the parameters it was written with (its key
-- would have expired). Another rate keeps whole tokens, floor(tokens / P0), clamped
-- to [-floor(2^50 / P), burst], in units of P (algo.rs: bucket_level).
local function bucket_level(tokens, ts, n0, p0, b0, now, n, p, burst)
  if n0 == n and p0 == p and b0 == burst then
    return tokens, math.huge
  end
  local until_ = bucket_full_at(tokens, ts, n0, p0, b0)
  if now >= until_ then
    return nil
  end
  if n0 == n and p0 == p then
    return tokens, until_
  end
  local pn = max(p, 1)
  local q = clamp(floor_div_signed(tokens, max(p0, 1)), -floor_div(MAX_DEBT, pn), burst)
  return q * pn, until_
end

-- `params` is "<n> <p> <burst>" as sent (request.lua), the tail of the state.
local function token_bucket(key, now, cost, n_arg, p_arg, burst, max_delay, _, params)
  local n = max(n_arg, 1)
  local p = max(p_arg, 1)
  local cap = burst * p
  local stored, ts, until_ = cap, now, math.huge
  local s = states[key] or redis.call('GET', key)
  if s then
    local t, t0, n0, p0, b0 = string.match(s, '^(%-?%d+) (%d+) (%d+) (%d+) (%d+)$')
    if t then
      t0 = tonumber(t0)
      local level, u = bucket_level(tonumber(t), t0, tonumber(n0), tonumber(p0), tonumber(b0),
        now, n_arg, p_arg, burst)
      if level then
        stored, ts, until_ = level, t0, u
      end
    end
  end
  -- Refill: full if tokens >= C or elapsed >= ceil((C - tokens) / N).
  local elapsed = max(now - ts, 0)
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
  local remaining = floor_div(max(level, 0), p)
  local reset = ceil_div(cap - level, n)
  if not allowed then
    -- Full, and passing, by `until_` at the latest.
    return false, remaining, min(reset, until_ - now), min(wait, until_ - now), 0
  end
  return true, remaining, reset, 0, delay,
    text('%d %d %s', after, now, params), now + ceil_div(cap - after, n)
end
