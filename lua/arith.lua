-- Exact integer helpers shared by every algorithm. Lua numbers are doubles: every
-- integer sluice stores stays below 2^53 (config validation sees to it), so sums,
-- differences and products of them are exact, but a quotient is rounded and
-- math.floor(a / b) can land one off when a / b rounds up to a whole number. These
-- helpers correct the rounded quotient with exact multiplications.

-- The math functions every algorithm uses, as locals (a global lookup costs).
local floor, ceil, max, min = math.floor, math.ceil, math.max, math.min

-- floor(a / b) for integers a >= 0, b > 0.
local function floor_div(a, b)
  local q = floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

-- ceil(a / b) for integers b > 0; 0 when a <= 0.
local function ceil_div(a, b)
  if a <= 0 then
    return 0
  end
  local q = floor_div(a, b)
  if q * b < a then
    q = q + 1
  end
  return q
end

-- floor(a / b) for any integer a, b > 0: towards minus infinity for negative a
-- (algo.rs: floor_div).
local function floor_div_signed(a, b)
  if a >= 0 then
    return floor_div(a, b)
  end
  return -ceil_div(-a, b)
end

-- x clamped to [lo, hi].
local function clamp(x, lo, hi)
  return min(max(x, lo), hi)
end

-- The lowest level, in units, a state converted to other parameters keeps: booked
-- delays beyond it are forgotten rather than carried into inexact numbers
-- (algo.rs: MAX_DEBT).
local MAX_DEBT = 2 ^ 50

-- Whether a request that must wait `wait` µs for capacity is admitted and how long
-- it waits: at once when nothing is owed, after the wait in delay mode when it fits
-- in max_delay, else refused (algo.rs: admit_after).
local function admit_after(wait, max_delay)
  if wait == 0 then
    return true, 0
  elseif max_delay > 0 and wait <= max_delay then
    return true, wait
  end
  return false, 0
end

-- Rust's saturating float-to-unsigned cast: negative becomes 0.
local function unsigned(x)
  if x < 0 then
    return 0
  end
  return x
end

-- An integer as Redis command text. Redis formats Lua numbers itself with limited
-- precision in some versions; "%d" prints all digits of a 64-bit integer.
local function int(x)
  return string.format('%d', x)
end

-- The TTL, in ms, of a key whose state stops mattering at `expires_at` (µs): past
-- it, rounded up, plus 1 ms; as command text. The last one made is kept: the
-- requests of a call on fresh keys, or in one window, mostly ask for the same.
local ttl_us, ttl_text
local function ttl_ms(expires_at, now)
  local us = expires_at - now
  if us ~= ttl_us then
    ttl_us, ttl_text = us, int(ceil_div(us, 1000) + 1)
  end
  return ttl_text
end

-- string.format(form, a, b, c): a state as written. The last one made is kept, as
-- the requests of a call on fresh keys, or in one window, mostly write the same
-- state (formatting costs more than the rest of an algorithm's arithmetic).
local text_form, text_a, text_b, text_c, text_made
local function text(form, a, b, c)
  if a ~= text_a or b ~= text_b or c ~= text_c or form ~= text_form then
    text_form, text_a, text_b, text_c = form, a, b, c
    text_made = string.format(form, a, b, c)
  end
  return text_made
end

-- The string states (fixed_window, sliding_window, token_bucket, gcra) set by the
-- requests of this call, by key, when keys repeat in it (`repeats`: sluice says so,
-- as when many requests of one client waited for the same call). A request reads
-- what the requests before it in the call left: an algorithm reads
-- `states[key] or redis.call('GET', key)`. A key set again is not written again
-- for each request: once more when the call ends (`flush`), as the last one left it.
local repeats = false
local states, again, expiry = {}

-- Sets the state at `key`, which stops mattering at `expires_at` (µs), when keys
-- repeat (request.lua writes it at once otherwise).
local function put(key, state, expires_at, now)
  local seen = states[key]
  states[key] = state
  if seen == nil then
    redis.call('SET', key, state, 'PX', ttl_ms(expires_at, now))
    return
  end
  if not expiry[key] then
    again[#again + 1] = key
  end
  expiry[key] = expires_at
end

-- Writes the states set again after their first write, each once.
local function flush(now)
  for i = 1, #again do
    local key = again[i]
    redis.call('SET', key, states[key], 'PX', ttl_ms(expiry[key], now))
  end
end
