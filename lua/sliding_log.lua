-- sliding_log: exact; at most `limit` (summed cost) in any W-long interval ending
-- now. State: a sorted set with one member per unit of cost, scored by the time of
-- its request; an entry at ts stops counting at ts + W. Members must be unique even
-- within one microsecond: `uid` (instance id and request counter) and the unit's
-- index (left out when the request takes one unit). Nothing is removed unless the
-- request is admitted.
local function member(uid, cost, k)
  if cost == 1 then
    return uid
  end
  return uid .. ':' .. k
end

local function sliding_log(key, now, cost, limit, w, _, _, uid)
  w = max(w, 1)
  -- Live entries: ts + W > now, i.e. ts > now - W.
  local live_from = '(' .. int(now - w)
  local count = redis.call('ZCOUNT', key, live_from, '+inf')
  local after = count + cost
  if after <= limit then
    return true, limit - after, w, 0, 0, function()
      redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now - w))
      local score = int(now)
      local j = 1
      while j <= cost do
        local args = {}
        local last = min(cost, j + 499)
        for k = j, last do
          args[#args + 1] = score
          args[#args + 1] = member(uid, cost, k)
        end
        redis.call('ZADD', key, unpack(args))
        j = last + 1
      end
      redis.call('PEXPIRE', key, ttl_ms(now + w, now))
    end
  end
  -- need = count + cost - limit units must leave; the need-th oldest unit leaves at
  -- ts + W. With cost > limit the whole log is not enough: retry = W.
  local need = after - limit
  local retry = w
  if need <= count then
    local r = redis.call('ZRANGEBYSCORE', key, live_from, '+inf', 'WITHSCORES', 'LIMIT', need - 1, 1)
    retry = unsigned(tonumber(r[2]) + w - now)
  end
  -- reset = newest ts + W - now (0 if the log is empty).
  local reset = 0
  if count > 0 then
    local r = redis.call('ZREVRANGEBYSCORE', key, '+inf', live_from, 'WITHSCORES', 'LIMIT', 0, 1)
    reset = unsigned(tonumber(r[2]) + w - now)
  end
  return false, unsigned(limit - count), reset, retry, 0
end
