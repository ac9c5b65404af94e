-- The runner: decides every limit of one request, then, only if all admit, writes
-- every new state and gives each key a TTL relative to now, so it expires on its
-- own once it can no longer matter. A refused request writes nothing.
--
-- KEYS[i]   the state of limit i (all keys share one hash tag).
-- ARGV[1]   now in µs since the epoch; '' = the server's TIME (production).
-- ARGV[2]   max_delay_us (0 = reject mode).
-- ARGV[3]   a request id unique across instances (sliding_log members).
-- ARGV[4 + 5(i-1) ..] per limit: algorithm, cost, a, b, c where (a, b, c) is
--           (limit, window_us, 0) for the windows and logs, (count, per_us, burst)
--           for token_bucket and gcra, (limit, lease_us, 0) for concurrency.
-- Reply: {allowed, delay_us, now_us, then per limit: allowed, remaining, reset_us,
--         retry_after_us, delay_us}.
local algorithms = {
  fixed_window = fixed_window,
  sliding_window = sliding_window,
  sliding_log = sliding_log,
  token_bucket = token_bucket,
  gcra = gcra,
  concurrency = concurrency,
}

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end
local max_delay = tonumber(ARGV[2])
local uid = ARGV[3]

local reply = {1, 0, now}
local writers = {}
local allowed, delay = true, 0
for i = 1, #KEYS do
  local at = 3 + (i - 1) * 5
  local algorithm = algorithms[ARGV[at + 1]]
  if not algorithm then
    return redis.error_reply('sluice: unknown algorithm ' .. tostring(ARGV[at + 1]))
  end
  local o, write = algorithm(KEYS[i], now, tonumber(ARGV[at + 2]), tonumber(ARGV[at + 3]),
    tonumber(ARGV[at + 4]), tonumber(ARGV[at + 5]), max_delay, uid)
  if o[1] then
    reply[#reply + 1] = 1
    delay = math.max(delay, o[5])
  else
    reply[#reply + 1] = 0
    allowed = false
  end
  for k = 2, 5 do
    reply[#reply + 1] = o[k]
  end
  writers[i] = write
end

if not allowed then
  reply[1] = 0
  return reply
end
reply[2] = delay
for i = 1, #KEYS do
  local expires_at = writers[i]()
  redis.call('PEXPIRE', KEYS[i], int(ceil_div(expires_at - now, 1000) + 1))
end
return reply
