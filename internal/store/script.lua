-- quota: the take. This script takes tokens from a bucket for one caller,
-- or for several at once (a batch), each granted or refused on its own.
-- It is core.lua, classes.lua, timeline.lua, tenants.lua and this body,
-- joined in that order after the prelude (internal/store's scripts.go);
-- core.lua describes the bucket and its record.
--
-- KEYS[1..k]  the layers' keys, the first layer's being the bucket's key.
-- KEYS[k+1]   the control record.
-- ARGV[1]     "take".
-- ARGV[2]     now in microseconds, or "" to use the server's clock.
-- ARGV[3]     form (core.lua's uses): what each caller's ARGV hold,
--             "plain", "class" or "tenant" (see below).
-- ARGV[4]     the channel that announces the takes' pushes (see
--             classes.lua), or "" for none.
-- ARGV[5...]  the callers, each in as many ARGV as its form has
--             (stride), caller c's from x = 5 + (c-1) x stride:
--   ARGV[x]     its longest wait, in microseconds;
--   forms class and tenant:
--   ARGV[x+1]   its priority class, 0 to 7 (see classes.lua);
--   ARGV[x+2]   the minimum shares of the classes, from class 0 up,
--               separated by spaces, 0 for none; "" for none at all
--               (see classes.lua's Minimum shares);
--   form tenant:
--   ARGV[x+3]   the tenant it is for (see tenants.lua);
--   ARGV[x+4]   the tenant's weight, > 0; 0 for a caller for no tenant;
--   ARGV[x+5]   the most tenants the bucket keeps apart, of which this
--               one is not sure to be one; 0 for one that always is;
--   then, in its last k ARGV, the tokens it takes from each layer, >= 0.
-- The last 2k ARGV, after the callers: the layers' Limits (core.lua).
--
-- Reply: for each caller, {outcome, wait, tat_1, ..., tat_k, pos_1, ...,
-- pos_k}, integers, where outcome is one of:
--   1 granted: the tokens were taken from every layer; wait (us, rounded
--     to the nearest) is how long until they have accrued in all of
--     them, and pos_i the grant's position in layer i (see timeline.lua;
--     0 without a wait);
--   2 too long: the wait would exceed the caller's; nothing is taken, and
--     wait is how long it would have been;
--   3 paused: the bucket is paused until a resume, whatever the caller's
--     wait; nothing is taken, and wait is 0;
--   4 resuming: the fleet has yet to leave its local shares after an
--     outage, whatever the caller's wait; nothing is taken, and wait is 0;
--   5 crowded: the take would push a class below its own past that
--     class's minimum share; nothing is taken, and wait is how long until
--     the share has room (see classes.lua's Minimum shares);
--   6 held: a take for a tenant that is not admitted; nothing is taken,
--     and wait is how long until it may be, at most fairNap (see
--     tenants.lua).
-- The tats (us, rounded down) identify the take for a later refund. A
-- batch serves its callers in order, each from the bucket as the one
-- before it left it, and replies their replies one after another, m x (2
-- + 2k) integers, then the timeline's count (ev) the takes found, and now;
-- then, on a bucket that priority classes took from, pmax x k more, how
-- far pushes had moved each class's queue in each layer when the call
-- ended, in positions, class 0's first. A call whose callers were all
-- granted without a wait replies the integer 0 alone instead: the
-- cheapest reply there is, for the commonest case.
local GRANTED, TOO_LONG, PAUSED, RESUMING, CROWDED, HELD = 1, 2, 3, 4, 5, 6
local form, channel = uses, ARGV[4]
local stride = k + 1
if form == 'class' then
  stride = k + 3
elseif form == 'tenant' then
  stride = k + 6
elseif form ~= 'plain' then
  return redis.error_reply('quota: a take of form ' .. tostring(form))
end
local callers = (limits - 4) / stride -- core.lua's limits: the callers' ARGV end there
if k < 1 or callers < 1 or callers % 1 ~= 0 then
  return redis.error_reply('quota: a take of ' .. #ARGV .. ' arguments from ' .. k .. ' layers')
end
local queue = {} -- queue[i]: layer i's tat as the takes leave it
for i = 1, k do
  queue[i] = tats[i]
end

if form == 'tenant' then
  for c = 1, callers do
    local x = 5 + (c - 1) * stride
    local w = tonumber(ARGV[x + 4])
    if not w or w < 0 or w == math.huge or w ~= w then
      return redis.error_reply('quota: a take for a tenant of weight ' .. tostring(ARGV[x + 4]))
    end
    -- The tenants a batch names all ask now: each waits, for the turns
    -- of those served before it in the batch (see tenants.lua).
    if callers > 1 and w > 0 and tonumber(ARGV[x + 1]) == 0 then
      local e = tenantOf(ARGV[x + 3], w, tonumber(ARGV[x + 5]))
      e.due = math.max(e.due, now)
    end
  end
end

local reply -- the callers' replies, made for a batch or a caller not granted at once
if callers > 1 then
  reply = {}
end
local waited, pushed = false, false
for c = 1, callers do
  local x = 5 + (c - 1) * stride -- where caller c's ARGV begin
  local maxWait = tonumber(ARGV[x])
  if not maxWait then
    return redis.error_reply('quota: a take with a longest wait of ' .. tostring(ARGV[x]))
  end
  local n = {} -- n[i]: what it takes from layer i
  for i = 1, k do
    local amount = tonumber(ARGV[x + stride - k - 1 + i])
    if not amount or amount < 0 then
      return redis.error_reply('quota: a take of ' .. tostring(ARGV[x + stride - k - 1 + i]) .. ' from layer ' .. i)
    end
    n[i] = amount
  end
  local class, shares, tenant = 0, nil, nil
  if form ~= 'plain' then
    class = tonumber(ARGV[x + 1])
    if not class or class < 0 or class > 7 or class % 1 ~= 0 then
      return redis.error_reply('quota: a take of class ' .. tostring(ARGV[x + 1]))
    end
  end
  if class > 0 then
    loadClasses(class)
    shares = {} -- shares[j]: class j's minimum share, for j below class
    local j = 0
    for m in string.gmatch(ARGV[x + 2], '%S+') do
      if j < class then
        shares[j] = tonumber(m)
      end
      j = j + 1
    end
  end
  if form == 'tenant' and tonumber(ARGV[x + 4]) > 0 then
    tenant = tenantOf(ARGV[x + 3], tonumber(ARGV[x + 4]), tonumber(ARGV[x + 5]))
  end
  -- A take that would push a class past its minimum share waits until
  -- the class's push clock is back to now (see classes.lua's Minimum shares).
  local crowded = -math.huge
  for j = 0, class - 1 do
    local m = shares[j]
    if m and m > 0 and m < 1 then
      for i = 1, k do
        local t = queue[i]
        if j > 0 then
          t = tails[j][i] or now
        end
        if n[i] > 0 and t > now + fulls[i] + commit then
          crowded = math.max(crowded, pushClock(j, i) - now)
        end
      end
    end
  end
  -- from[i]: where the take queues in layer i, as a tat: behind every
  -- class for class 0; behind the classes at and above its own, and what
  -- is committed, for a higher class.
  local from = queue
  if class > 0 then
    from = {}
    for i = 1, k do
      from[i] = math.max(tails[class][i] or now, math.min(queue[i], now + fulls[i] + commit))
    end
  end
  local longest = -math.huge
  if paused and ends then
    longest = ends - now -- nothing falls due before the pause ends
  end
  for i = 1, k do
    local debt = from[i] - now -- refill already promised beyond now
    if debt < 0 then
      debt = 0
    end
    local wait = debt + n[i] / rates[i] * 1000000 - fulls[i]
    if wait > longest and n[i] > 0 then -- a layer asked nothing is no bar
      longest = wait
    end
  end
  local wait = math.floor(longest + 0.5)
  -- cost: the take's time at the slowest layer's rate, what its tenant
  -- is charged (see tenants.lua).
  local cost, admitted, retry = 0, true, 0
  if tenant then
    for i = 1, k do
      cost = math.max(cost, n[i] / rates[i] * 1000000)
    end
    if class == 0 and not (forever or resuming) and wait <= maxWait then
      admitted, retry = admit(tenant, cost, wait)
    end
  end
  local outcome = GRANTED
  if not admitted then
    outcome, wait = HELD, retry
  elseif crowded > 0 and not (forever or resuming) then
    outcome, wait = CROWDED, math.ceil(crowded)
  elseif resuming then
    outcome, wait = RESUMING, 0
  elseif forever then
    outcome, wait = PAUSED, 0
  elseif wait > maxWait then
    outcome = TOO_LONG
  elseif longest <= 0 then
    wait = 0
  end
  if outcome ~= GRANTED or wait ~= 0 then
    reply, waited = reply or {}, true
  end
  local o = reply and #reply
  if reply then
    reply[o + 1], reply[o + 2] = outcome, wait
  end
  if outcome ~= GRANTED then
    for i = 1, k do
      reply[o + 2 + i], reply[o + 2 + k + i] = math.floor(from[i]), 0
    end
  else
    -- Each layer counts the tokens from where its own queue has room
    -- (no sooner than a pause lets it), not from when the slowest layer
    -- gives them: a layer that could give them sooner holds the grant
    -- back no further than its own tokens, so that a give-back that
    -- moves the slowest layer's queue (timeline.lua) moves the grant.
    -- A layer whose lower classes the take pushes takes them where it
    -- queues, the commit point, which the pushes are reckoned from.
    local at = now
    if paused then
      at = since + shifted
    end
    if tenant then
      charge(tenant, cost, class, wait)
    end
    for i = 1, k do
      local v = from[i]
      if n[i] > 0 then
        local d = n[i] / rates[i] * 1000000
        if class > 0 and queue[i] > now + fulls[i] + commit then
          if not anchor then
            anchor, position = anchorsOf(KEYS, ctl)
          end
          v, queue[i] = push(i, class, from[i], d, queue[i], shares, anchor(i).scale)
          pushed = true
        else
          v = math.max(from[i], at) + d
          queue[i] = math.max(queue[i], v)
          for lower = 1, class - 1 do
            tails[lower][i] = v
          end
        end
        if class > 0 then
          tails[class][i], classesDirty = v, true
        end
      end
      if reply then
        -- The grant's position (see timeline.lua), for a caller that
        -- sleeps on it; 0 for one that does not.
        local p = 0
        if wait ~= 0 then
          if not anchor then
            anchor, position = anchorsOf(KEYS, ctl)
          end
          p = math.floor(position(i, math.floor(v) - fulls[i]))
        end
        reply[o + 2 + i], reply[o + 2 + k + i] = math.floor(v), p
      end
    end
  end
end
-- The layers the takes moved, written back as core.lua's write does
-- (which a plain take does not make), less what it does while a pause with
-- no end is in force: every take is refused then.
for i = 1, k do
  local v = queue[i]
  if v == tats[i] then
    -- unmoved
  elseif v <= now then
    redis.call('DEL', KEYS[i])
  else
    redis.call('SET', KEYS[i], v, 'PX', math.ceil((v - now) / 1000))
  end
end
if fair and fair.dirty then
  saveFair()
  if not classesDirty then
    expire()
  end
end
if classesDirty then
  saveClasses()
  if pushed then
    announcePushes(channel)
  end
  expire()
end
if not waited then
  return 0
end
-- The timeline's count the takes found, for the callers that sleep on
-- their grants (see timeline.lua).
reply[#reply + 1] = tonumber(redis.call('HGET', ctl, 'ev')) or 0
reply[#reply + 1] = now
if pmax > 0 then
  for _, v in ipairs(pushList()) do
    reply[#reply + 1] = v
  end
end
return reply
