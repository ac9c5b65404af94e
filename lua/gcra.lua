-- gcra: the theoretical arrival time `tat` is when the bucket would be full again;
-- a request pushes it by its emission interval and is admitted while the tat stays
-- within burst * P / N of now. State: a string "<tat> <ahead> <n> <p> <burst>": the
-- tat, how far ahead of the time it was set it was, and the rate and burst it was
-- computed under.

-- A tat set at ts under (n0, p0, b0), under (n, p, burst): the whole tokens available
-- then, avail = floor((B0 * P0 - (tat - ts) * N0) / P0), clamped to
-- [-floor(2^50 / P), B], leave used = B - avail and the tat becomes
-- ts + floor(used * P / N) (algo.rs: gcra_convert).
local function gcra_convert(tat, ts, n0, p0, b0, n, p, burst)
  local nn, pn = max(n, 1), max(p, 1)
  local p0n = max(p0, 1)
  local owed = (tat - ts) * max(n0, 1)
  local avail = clamp(floor_div_signed(b0 * p0n - owed, p0n), -floor_div(MAX_DEBT, pn), burst)
  return ts + floor_div(burst * pn - avail * pn, nn)
end

-- `params` is "<n> <p> <burst>" as sent (request.lua), the tail of the state.
local function gcra(key, now, cost, n_arg, p_arg, burst, max_delay, _, params)
  local n = max(n_arg, 1)
  local p = max(p_arg, 1)
  -- inc = floor(cost * P / N), at least 1 for cost > 0; L = burst * P.
  local inc = floor_div(cost * p, n)
  if inc == 0 and cost > 0 then
    inc = 1
  end
  local span = burst * p
  -- tat = now when empty. Written under other parameters: empty from its own tat on
  -- (when its key expires), converted until then (`until_`) (algo.rs: gcra_tat).
  local tat, until_ = now, math.huge
  local s = states[key] or redis.call('GET', key)
  if s then
    -- Most often written under the parameters sent now: then its tail is `params`,
    -- the same text (and string), not read again.
    local t, ahead, rest = string.match(s, '^(%d+) (%d+) (.*)$')
    local n0, p0, b0
    if rest == params then
      n0, p0, b0 = n_arg, p_arg, burst
    elseif rest then
      n0, p0, b0 = string.match(rest, '^(%d+) (%d+) (%d+)$')
      if not n0 then
        t = nil
      end
    end
    if t then
      t, ahead, n0, p0, b0 = tonumber(t), tonumber(ahead), tonumber(n0), tonumber(p0), tonumber(b0)
      if n0 == n_arg and p0 == p_arg and b0 == burst then
        tat = t
      elseif t > now then
        tat, until_ = gcra_convert(t, t - ahead, n0, p0, b0, n_arg, p_arg, burst), t
      end
    end
  end
  local base = max(tat, now)
  local new_tat = base + inc
  -- excess = (new_tat - now) * N; admitted at once iff excess <= L.
  local excess = (new_tat - now) * n
  local wait = 0
  if excess > span then
    wait = ceil_div(excess - span, n)
  end
  local allowed, delay = admit_after(wait, max_delay)
  local t = base
  if allowed then
    t = new_tat
  end
  local remaining = floor_div(max(span - (t - now) * n, 0), p)
  if not allowed then
    -- Empty, and passing, by `until_` at the latest.
    return false, remaining, min(t - now, until_ - now), min(wait, until_ - now), 0
  end
  return true, remaining, t - now, 0, delay,
    text('%d %d %s', new_tat, new_tat - now, params), new_tat
end
