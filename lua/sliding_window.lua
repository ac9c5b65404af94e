-- sliding_window: the previous window's count weighted by the share of it still
-- inside the sliding window, plus the current count. The weighting is done in
-- doubles in exactly the order of `algo::sliding_window`, so both stores decide
-- bit for bit alike. State: a string "<window index> <previous count> <current count>".
local function sliding_window(key, now, cost, limit, w)
  w = max(w, 1)
  -- idx = now / W, e = offset into the current window.
  local idx = floor_div(now, w)
  local e = now - idx * w
  -- (prev, curr): as stored in this window; shifted if stored in the previous one.
  local prev, curr = 0, 0
  local s = states[key] or redis.call('GET', key)
  if s then
    local i, p, c = string.match(s, '^(%d+) (%d+) (%d+)$')
    if i then
      local stored = tonumber(i)
      if stored == idx then
        prev, curr = tonumber(p), tonumber(c)
      elseif stored + 1 == idx then
        prev, curr = tonumber(c), 0
      end
    end
  end
  -- weight = (W - e) / W; estimate = prev * weight + curr.
  local weight = (w - e) / w
  local estimate = prev * weight + curr
  local allowed = estimate + cost <= limit
  local curr_after = curr
  if allowed then
    curr_after = curr + cost
  end
  -- reset: W - e if the current window is empty, else 2W - e.
  local reset = 2 * w - e
  if curr_after == 0 then
    reset = w - e
  end
  if allowed then
    local remaining = unsigned(floor(limit - estimate - cost))
    return true, remaining, reset, 0, 0, text('%d %d %d', idx, prev, curr_after),
      (idx + 2) * w
  end
  local retry
  if curr + cost <= limit then
    -- Later in this window, once prev has decayed: the earliest offset e' with
    -- prev*(W-e')/W + curr + cost <= limit; retry = e' - e, at least 1.
    local free = limit - cost - curr
    local at = unsigned(ceil(w - free * w / prev))
    retry = max(at - e, 1)
  else
    -- In the next window, where prev' = curr and curr' = 0.
    local free = max(limit - cost, 0)
    local into_next = w
    if curr ~= 0 then
      into_next = unsigned(ceil(max(w - free * w / curr, 0)))
    end
    retry = (w - e) + into_next
  end
  local remaining = unsigned(floor(max(limit - estimate, 0)))
  return false, remaining, reset, retry, 0
end
