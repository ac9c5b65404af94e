-- gcra: the theoretical arrival time `tat` is when the bucket would be full again;
-- a request pushes it by its emission interval and is admitted while the tat stays
-- within burst * P / N of now. State: a string, the tat.
local function gcra(key, now, cost, n, p, burst, max_delay)
  n = math.max(n, 1)
  p = math.max(p, 1)
  -- inc = floor(cost * P / N), at least 1 for cost > 0; L = burst * P.
  local inc = floor_div(cost * p, n)
  if inc == 0 and cost > 0 then
    inc = 1
  end
  local span = burst * p
  local tat = tonumber(redis.call('GET', key)) or now
  local base = math.max(tat, now)
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
  local remaining = floor_div(math.max(span - (t - now) * n, 0), p)
  if not allowed then
    return {false, remaining, t - now, wait, 0}
  end
  return {true, remaining, t - now, 0, delay}, function()
    redis.call('SET', key, int(new_tat))
    return new_tat
  end
end
