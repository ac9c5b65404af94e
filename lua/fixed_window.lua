-- fixed_window: at most `limit` per aligned window [idx*W, (idx+1)*W).
-- State: a string "<window index> <count in that window>".
-- Returns the outcome (allowed, remaining, reset, retry_after, delay) and, when
-- admitted, the new state and when it stops mattering (request.lua writes them).
local function fixed_window(key, now, cost, limit, w)
  w = max(w, 1)
  -- idx = now / W; the stored count counts only in its own window.
  local idx = floor_div(now, w)
  local count = 0
  local s = redis.call('GET', key)
  if s then
    local i, c = string.match(s, '^(%d+) (%d+)$')
    if i and tonumber(i) == idx then
      count = tonumber(c)
    end
  end
  local until_end = (idx + 1) * w - now
  -- Admit iff count + cost <= limit.
  local after = count + cost
  if after <= limit then
    return true, limit - after, until_end, 0, 0, string.format('%d %d', idx, after), (idx + 1) * w
  end
  return false, unsigned(limit - count), until_end, until_end, 0
end
