-- fixed_window: at most `limit` per aligned window [idx*W, (idx+1)*W).
-- State: a hash {i = window index, c = count in that window}.
-- Returns the outcome {allowed, remaining, reset, retry_after, delay} and, when
-- admitted, a writer that stores the new state and returns its expiry time.
local function fixed_window(key, now, cost, limit, w)
  w = math.max(w, 1)
  -- idx = now / W; the stored count counts only in its own window.
  local idx = floor_div(now, w)
  local s = redis.call('HMGET', key, 'i', 'c')
  local count = 0
  if s[1] and tonumber(s[1]) == idx then
    count = tonumber(s[2]) or 0
  end
  local until_end = (idx + 1) * w - now
  -- Admit iff count + cost <= limit.
  local after = count + cost
  if after <= limit then
    return {true, limit - after, until_end, 0, 0}, function()
      redis.call('HSET', key, 'i', int(idx), 'c', int(after))
      return (idx + 1) * w
    end
  end
  return {false, unsigned(limit - count), until_end, until_end, 0}
end
