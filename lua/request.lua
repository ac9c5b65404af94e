-- The runner: decides one or more requests, in order, as if each were a call of its
-- own. For each it decides every limit, then, only if all admit, writes every new
-- state, each key with a TTL relative to now, so it expires on its own once it can
-- no longer matter. A refused request writes nothing. Several requests share one
-- call when sluice has more than one waiting for Redis: what a request sees is what
-- the requests before it in the call left.
--
-- An algorithm returns its outcome (allowed, remaining, reset, retry_after, delay)
-- and, when it admits, what to write: a string state and the time it stops
-- mattering (written here, with `SET ... PX`), or a function that writes a sorted
-- set and its TTL itself. A request's limits come as one argument, parsed once per
-- call however many requests of the call share it (those of one route do).
--
-- KEYS        the state of each limit of each request, in order (the keys of one
--             request share one hash tag).
-- ARGV[1]     now in µs since the epoch; '' = the server's TIME (production); or
--             'r' and a time: refund (lua/refund.lua) the charges each request of
--             the call made at that time, instead of deciding anything; or 'c',
--             and optionally a time: charge each limit of each request its cost
--             whatever is left (what the upstream's response said a request cost:
--             a window or log counts past its limit, a bucket goes into debt).
--             Deciding or charging, after a '*' when some key repeats in the call
--             (arith.lua: `repeats`).
-- Then two per request:
--   <limits>     "<max_delay_us>" then per limit " <algorithm> <cost>[+<want>] <a> <b> <c>":
--                max_delay_us 0 = reject mode; the algorithm as one letter, in
--                upper case for a limit on trial (`shadow`: its refusal refuses
--                nothing, and it is charged only when it admits), after a '~' for
--                a limit charged from the response (checked for its cost, never
--                written by a decision); (a, b,
--                c) = (limit, window_us, 0) for the windows and logs, (limit,
--                0, 0) for fixed_window by calendar month (letter m), (count,
--                per_us, burst) for token_bucket and gcra, (limit, lease_us, 0) for
--                concurrency;
--   <id>         a request id unique across instances (sliding_log members,
--                concurrency leases); '' when no limit needs one.
--                `+<want>` (`reserve`): when the request is admitted at once, take up
--                to want more units of what is left for the instance to hold;
-- Reply: integers, then the time the call decided at (now), packed as one string
--        of little-endian doubles, 8 bytes each (Lua's numbers as they are; sluice
--        truncates each toward zero, as Redis does an integer reply). Three per
--        limit of each request (four when its limits carry a `+<want>`: then the
--        units taken beyond the cost last): remaining,
--        reset_us, and the limit's decision: the µs it makes the request wait (>= 0)
--        if it admits, else -(retry_after_us + 1). A request is admitted if all of
--        its limits not on trial admit (an algorithm that admits has no retry_after, one that
--        refuses no wait). Packed, the reply is one value for Redis to send and
--        for sluice's Redis client to read; an array costs both a value a number.
local now, refunding, forcing
local time = ARGV[1]
local mode = string.sub(time, 1, 1)
if mode == '*' then
  repeats, again, expiry = true, {}, {}
  time = string.sub(time, 2)
  mode = string.sub(time, 1, 1)
end
if mode == 'r' then
  now, refunding = tonumber(string.sub(time, 2)), true
elseif mode == 'c' then
  now, forcing = tonumber(string.sub(time, 2)), true
elseif time ~= '' then
  now = tonumber(time)
end
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
-- What a charge from a response is held to: no limit, no wait that matters
-- (algo.rs: UNBOUNDED).
local UNBOUNDED = 2 ^ 52

local algorithms = {
  t = token_bucket,
  g = gcra,
  f = fixed_window,
  m = calendar_month,
  w = sliding_window,
  l = sliding_log,
  c = concurrency,
}
-- Each limits argument seen in this call, parsed: {max_delay, {algorithm, cost, a,
-- b, c, "a b c"} per limit}; the parameters as sent are the tail of the states that
-- record them (token_bucket, gcra), which saves formatting them for every write.
local parsed = {}
local out, o = {}, 0
local writes = {false, false}
local k, a = 0, 1
local nkeys, nargs = #KEYS, #ARGV
while a < nargs do
  local spec, uid = ARGV[a + 1], ARGV[a + 2]
  a = a + 2
  local limits = parsed[spec]
  if not limits then
    local max_delay = tonumber(string.match(spec, '^%d+') or '')
    if not max_delay then
      return redis.error_reply('sluice: bad limits ' .. spec)
    end
    limits = {max_delay}
    for peek, code, cost, want, params, x, y, z in string.gmatch(spec, ' (~?)(%a) (%d+)%+?(%d*) ((%d+) (%d+) (%d+))') do
      local lower = string.lower(code)
      local algorithm = algorithms[lower]
      if not algorithm then
        return redis.error_reply('sluice: unknown limit ' .. code)
      end
      if want ~= '' then
        limits.taking = true
      end
      limits[#limits + 1] = {algorithm, tonumber(cost), tonumber(x), tonumber(y), tonumber(z), params, code ~= lower, lower, peek == '~', tonumber(want) or 0}
    end
    parsed[spec] = limits
  end
  local max_delay, n = limits[1], #limits - 1
  if k + n > nkeys then
    return redis.error_reply('sluice: more limits than keys')
  end
  if refunding then
    for i = 1, n do
      local p = limits[i + 1]
      refunds[p[8]](KEYS[k + i], now, p[2], p[3], p[4], p[5], uid, p[6])
    end
  elseif forcing then
    for i = 1, n do
      local p = limits[i + 1]
      -- (A cost of 0 charges nothing: algo.rs: charge_anyway.)
      local a, wait = p[3], max_delay
      if p[8] == 't' or p[8] == 'g' then
        wait = UNBOUNDED
      else
        a = UNBOUNDED
      end
      local ok, _, _, _, _, state, expires_at = false
      if p[2] > 0 then
        ok, _, _, _, _, state, expires_at = p[1](KEYS[k + i], now, p[2], a, p[4], p[5], wait, uid, p[6])
      end
      if ok and type(state) == 'string' then
        if repeats then
          put(KEYS[k + i], state, expires_at, now)
        else
          redis.call('SET', KEYS[k + i], state, 'PX', ttl_ms(expires_at, now))
        end
      elseif ok and state then
        state()
      end
    end
  else
    local allowed = true
    for i = 1, n do
      local p = limits[i + 1]
      local ok, remaining, reset, retry, wait, state, expires_at =
        p[1](KEYS[k + i], now, p[2], p[3], p[4], p[5], max_delay, uid, p[6])
      local decision = wait
      if not ok then
        decision = -retry - 1
        -- A limit on trial refuses nothing (and, refusing, writes nothing below).
        if not p[7] then
          allowed = false
        end
      end
      out[o + 1] = remaining
      out[o + 2] = reset
      out[o + 3] = decision
      o = o + 3
      -- `reserve`: admitted at once, take up to `want` more of what is left for the
      -- instance to hold (algo.rs: Algorithm::take): cost + extra decided again, and
      -- kept only if that too is admitted at once.
      if limits.taking then
        local extra = 0
        if ok and wait == 0 and p[10] > 0 and remaining > 0 then
          extra = math.min(p[10], remaining)
          local ok2, _, _, _, wait2, state2, expires2 =
            p[1](KEYS[k + i], now, p[2] + extra, p[3], p[4], p[5], max_delay, uid, p[6])
          if ok2 and wait2 == 0 then
            state, expires_at = state2, expires2
          else
            extra = 0
          end
        end
        out[o + 1] = extra
        o = o + 1
      end
      -- A limit charged from the response is only checked here.
      writes[2 * i - 1] = not p[9] and state
      writes[2 * i] = expires_at
    end
    if allowed then
      for i = 1, n do
        local state = writes[2 * i - 1]
        if type(state) == 'string' then
          if repeats then
            put(KEYS[k + i], state, writes[2 * i], now)
          else
            redis.call('SET', KEYS[k + i], state, 'PX', ttl_ms(writes[2 * i], now))
          end
        elseif state then
          state()
        end
      end
    end
  end
  k = k + n
end
if repeats then
  flush(now)
end
out[o + 1] = now
-- `unpack` takes a bounded number of values: packed 200 at a time.
local packed = {}
for i = 1, #out, 200 do
  local last = math.min(#out, i + 199)
  packed[#packed + 1] = struct.pack('<' .. string.rep('d', last - i + 1), unpack(out, i, last))
end
return table.concat(packed)
