-- fixed_window: at most `limit` per aligned window [idx*W, (idx+1)*W), or per
-- calendar month (UTC) with `window: month`.
-- State: a string "<window index> <count in that window>".
-- Returns the outcome (allowed, remaining, reset, retry_after, delay) and, when
-- admitted, the new state and when it stops mattering (request.lua writes them).

-- Decides against window `idx`, which holds `now` and ends at `ends`.
local function window_decide(key, now, cost, limit, idx, ends)
  -- The stored count counts only in its own window.
  local count = 0
  local s = states[key] or redis.call('GET', key)
  if s then
    local i, c = string.match(s, '^(%d+) (%d+)$')
    if i and tonumber(i) == idx then
      count = tonumber(c)
    end
  end
  local until_end = ends - now
  -- Admit iff count + cost <= limit.
  local after = count + cost
  if after <= limit then
    return true, limit - after, until_end, 0, 0, text('%d %d', idx, after), ends
  end
  return false, unsigned(limit - count), until_end, until_end, 0
end

local function fixed_window(key, now, cost, limit, w)
  w = max(w, 1)
  -- idx = now / W; the window ends at (idx+1)*W.
  local idx = floor_div(now, w)
  return window_decide(key, now, cost, limit, idx, (idx + 1) * w)
end

-- Calendar months, UTC: Howard Hinnant's civil_from_days and days_from_civil for
-- dates from 1970 on, in exact integers (no os.date in Redis); algo.rs: month_of,
-- month_start_us.
local DAY_US = 86400000000

-- The month holding day `days` (since 1970-01-01): its year and month (1 to 12).
local function civil_month(days)
  local z = days + 719468
  local era = floor_div(z, 146097)
  local doe = z - era * 146097
  local yoe = floor_div(doe - floor_div(doe, 1460) + floor_div(doe, 36524) - floor_div(doe, 146096), 365)
  local doy = doe - (365 * yoe + floor_div(yoe, 4) - floor_div(yoe, 100))
  -- mp counts months from March: January and February belong to the next year.
  local mp = floor_div(5 * doy + 2, 153)
  if mp < 10 then
    return era * 400 + yoe, mp + 3
  end
  return era * 400 + yoe + 1, mp - 9
end

-- Days since 1970-01-01 of the first of `month` in `year`.
local function first_day(year, month)
  local y, mp = year, month - 3
  if month <= 2 then
    y, mp = year - 1, month + 9
  end
  local era = floor_div(y, 400)
  local yoe = y - era * 400
  local doe = yoe * 365 + floor_div(yoe, 4) - floor_div(yoe, 100) + floor_div(153 * mp + 2, 5)
  return era * 146097 + doe - 719468
end

-- fixed_window with `window: month`: idx = (year - 1970) * 12 + month - 1; the
-- window ends at 00:00 UTC on the first of the next month.
local function calendar_month(key, now, cost, limit)
  local year, month = civil_month(floor_div(now, DAY_US))
  local idx = (year - 1970) * 12 + month - 1
  if month == 12 then
    year, month = year + 1, 1
  else
    month = month + 1
  end
  return window_decide(key, now, cost, limit, idx, first_day(year, month) * DAY_US)
end
