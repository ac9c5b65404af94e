-- Refunds: undo a charge of `cost` made at `at` (this server's time then) on a key's
-- state as it is now, with whatever other requests charged since (algo.rs:
-- Algorithm::refund). On a Redis Cluster the keys of one request can live on
-- different nodes, each decided by a call of its own; when one refuses, sluice sends
-- the others this, so the refused request ends up charging nothing. Exact for the
-- windows, the log and the leases; a bucket gets its tokens back up to its capacity,
-- a gcra its time back down to when it was last set. A state written since under
-- other parameters (a reload), or a window that rolled past the charge, is left as
-- it is. Nothing here extends a key's life: KEEPTTL.

local function refund_fixed_window(key, at, cost, _, w)
  local s = redis.call('GET', key)
  local i, c = string.match(s or '', '^(%d+) (%d+)$')
  if i and tonumber(i) == floor_div(at, max(w, 1)) then
    redis.call('SET', key, string.format('%d %d', tonumber(i), unsigned(tonumber(c) - cost)), 'KEEPTTL')
  end
end

local function refund_calendar_month(key, at, cost)
  local s = redis.call('GET', key)
  local i, c = string.match(s or '', '^(%d+) (%d+)$')
  local year, month = civil_month(floor_div(at, DAY_US))
  if i and tonumber(i) == (year - 1970) * 12 + month - 1 then
    redis.call('SET', key, string.format('%d %d', tonumber(i), unsigned(tonumber(c) - cost)), 'KEEPTTL')
  end
end

local function refund_sliding_window(key, at, cost, _, w)
  local s = redis.call('GET', key)
  local i, p, c = string.match(s or '', '^(%d+) (%d+) (%d+)$')
  if not i then
    return
  end
  i, p, c = tonumber(i), tonumber(p), tonumber(c)
  local charged = floor_div(at, max(w, 1))
  if i == charged then
    c = unsigned(c - cost)
  elseif i == charged + 1 then
    p = unsigned(p - cost)
  else
    return
  end
  redis.call('SET', key, string.format('%d %d %d', i, p, c), 'KEEPTTL')
end

local function refund_sliding_log(key, _, cost, _, _, _, uid)
  local j = 1
  while j <= cost do
    local members = {}
    for k = j, min(cost, j + 499) do
      members[#members + 1] = member(uid, cost, k)
    end
    redis.call('ZREM', key, unpack(members))
    j = j + 500
  end
end

local function refund_token_bucket(key, _, cost, n_arg, p_arg, burst, _, params)
  local s = redis.call('GET', key)
  local t, ts, rest = string.match(s or '', '^(%-?%d+) (%d+) (.*)$')
  if not t or rest ~= params then
    return
  end
  local p = max(p_arg, 1)
  local back = min(tonumber(t) + cost * p, burst * p)
  redis.call('SET', key, string.format('%d %d ', back, tonumber(ts)) .. params, 'KEEPTTL')
end

local function refund_gcra(key, _, cost, n_arg, p_arg, burst, _, params)
  local s = redis.call('GET', key)
  local t, ahead, rest = string.match(s or '', '^(%d+) (%d+) (.*)$')
  if not t or rest ~= params then
    return
  end
  local inc = floor_div(cost * max(p_arg, 1), max(n_arg, 1))
  if inc == 0 and cost > 0 then
    inc = 1
  end
  t, ahead = tonumber(t), tonumber(ahead)
  local set_at = t - ahead
  local back = max(t - inc, set_at)
  redis.call('SET', key, string.format('%d %d ', back, back - set_at) .. params, 'KEEPTTL')
end

local function refund_concurrency(key, _, _, _, _, _, uid)
  redis.call('ZREM', key, uid)
end

local refunds = {
  f = refund_fixed_window,
  m = refund_calendar_month,
  w = refund_sliding_window,
  l = refund_sliding_log,
  t = refund_token_bucket,
  g = refund_gcra,
  c = refund_concurrency,
}
