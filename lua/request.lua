-- The runner: decides every limit of one request, then, only if all admit, writes
-- every new state, each key with a TTL relative to now, so it expires on its own
-- once it can no longer matter. A refused request writes nothing.
--
-- An algorithm returns its outcome (allowed, remaining, reset, retry_after, delay)
-- and, when it admits, what to write: a string state and the time it stops
-- mattering (written here, with `SET ... PX`), or a function that writes a sorted
-- set and its TTL itself. Tables are sized up front for one limit, the common case,
-- and the algorithm is picked by comparing its letter: runs stay free of table growth.
--
-- KEYS[i]     the state of limit i (all keys share one hash tag).
-- ARGV[1]     now in µs since the epoch; '' = the server's TIME (production).
-- ARGV[2]     max_delay_us (0 = reject mode).
-- ARGV[3]     a request id unique across instances (sliding_log members, concurrency
--             leases); '' when no limit needs one.
-- ARGV[3 + i] limit i: "<algorithm> <cost> <a> <b> <c>", the algorithm as one letter
--             (see `algorithms`), (a, b, c) = (limit, window_us, 0) for the windows and
--             logs, (count, per_us, burst) for token_bucket and gcra, (limit, lease_us,
--             0) for concurrency.
-- Reply: one string of integers separated by spaces, "<allowed> <delay_us>" then per
--        limit " <allowed> <remaining> <reset_us> <retry_after_us> <delay_us>" (one
--        string is cheaper for the client to read than an array of integers).
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end
local max_delay = tonumber(ARGV[2])
local uid = ARGV[3]
if #KEYS == 0 then
  return '1 0'
end

local outcomes = {false}
local writes = {false, false}
local allowed, delay = true, 0
for i = 1, #KEYS do
  local spec = ARGV[3 + i]
  local code, cost, a, b, c = string.match(spec, '^(%a) (%d+) (%d+) (%d+) (%d+)$')
  local algorithm
  if code == 't' then
    algorithm = token_bucket
  elseif code == 'g' then
    algorithm = gcra
  elseif code == 'f' then
    algorithm = fixed_window
  elseif code == 'w' then
    algorithm = sliding_window
  elseif code == 'l' then
    algorithm = sliding_log
  elseif code == 'c' then
    algorithm = concurrency
  else
    return redis.error_reply('sluice: unknown limit ' .. tostring(spec))
  end
  local ok, remaining, reset, retry, wait, state, expires_at = algorithm(KEYS[i], now,
    tonumber(cost), tonumber(a), tonumber(b), tonumber(c), max_delay, uid)
  local admitted = 1
  if ok then
    if wait > delay then
      delay = wait
    end
  else
    admitted = 0
    allowed = false
  end
  outcomes[i] = string.format('%d %d %d %d %d', admitted, remaining, reset, retry, wait)
  writes[2 * i - 1] = state
  writes[2 * i] = expires_at
end

if not allowed then
  return '0 0 ' .. table.concat(outcomes, ' ')
end
for i = 1, #KEYS do
  local state = writes[2 * i - 1]
  if type(state) == 'string' then
    redis.call('SET', KEYS[i], state, 'PX', ttl_ms(writes[2 * i], now))
  else
    state()
  end
end
return string.format('1 %d ', delay) .. table.concat(outcomes, ' ')
