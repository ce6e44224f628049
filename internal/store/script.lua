-- quota: the take. This script takes tokens from a bucket for one caller,
-- or for several at once (a batch), each granted or refused on its own.
-- It is core.lua, plain.lua, layers.lua, classes.lua, timeline.lua,
-- tenants.lua and this body, joined in that order after the prelude
-- (internal/store's scripts.go); core.lua describes the bucket and its
-- record. plain.lua serves the commonest takes whole, as this body would.
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
--   ARGV[x+6]   when the take was first held, in microseconds on the
--               server's clock; 0 for one never held (see tenants.lua);
--   then, in its last k ARGV, the tokens it takes from each layer, >= 0.
-- The last 2k ARGV, after the callers: the layers' Limits (layers.lua).
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
-- The tats (us, rounded down) identify the take for a later refund; a
-- caller granted without a wait has 0 for each, as for its positions
-- (Decode keeps neither). A batch serves its callers in order, each from the bucket as the one
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
  stride = k + 7
elseif form ~= 'plain' then
  return redis.error_reply('quota: a take of form ' .. tostring(form))
end
local callers = (limits - 4) / stride -- layers.lua's limits: the callers' ARGV end there
if k < 1 or callers < 1 or callers % 1 ~= 0 then
  return redis.error_reply('quota: a take of ' .. #ARGV .. ' arguments from ' .. k .. ' layers')
end
local queue = {} -- queue[i]: layer i's tat as the takes leave it
for i = 1, k do
  queue[i] = tats[i]
end

if form == 'tenant' then
  local err = weigh(callers, stride) -- tenants.lua
  if err then
    return err
  end
end

-- reply: the callers' replies, made once a caller is not granted at once.
local reply, pushed
-- The callers of a batch mostly ask alike: a caller's ARGV are converted
-- only where they differ from the caller's before it (equal strings are
-- one string in Lua, and compare at no cost). n[i]: what the caller
-- takes from layer i, converted from n[k + i], its ARGV.
local maxWait, waits
local n = {}
-- earliest: the least wait, for nothing falls due before a pause in force
-- ends; at: where the layers count a grant's tokens from (see below).
local earliest, at = -math.huge, now
if paused then
  at = since + shifted
  if ends then
    earliest = ends - now
  end
end
for c = 1, callers do
  local x = 5 + (c - 1) * stride -- where caller c's ARGV begin
  if ARGV[x] ~= waits then
    waits = ARGV[x]
    maxWait = tonumber(waits)
    if not maxWait or maxWait < 0 then
      return redis.error_reply('quota: a take with a longest wait of ' .. tostring(waits))
    end
  end
  local y = x + stride - k - 1 -- its amount of layer i is ARGV[y + i]
  for i = 1, k do
    local a = ARGV[y + i]
    if a ~= n[k + i] then
      local amount = tonumber(a)
      if not amount or amount < 0 then
        return redis.error_reply('quota: a take of ' .. tostring(a) .. ' from layer ' .. i)
      end
      n[i], n[k + i] = amount, a
    end
  end
  -- from[i]: where the take queues in layer i, as a tat: behind every
  -- class for class 0, behind the classes at and above its own for a
  -- higher one (see classes.lua's rank, which tells crowded too).
  local class, shares, crowded, from, tenant = 0, nil, 0, queue, nil
  if form ~= 'plain' then
    class = tonumber(ARGV[x + 1])
    if not class or class < 0 or class > 7 or class % 1 ~= 0 then
      return redis.error_reply('quota: a take of class ' .. tostring(ARGV[x + 1]))
    end
    if class > 0 then
      shares, crowded, from = rank(class, ARGV[x + 2], n, queue)
    end
    if form == 'tenant' and tonumber(ARGV[x + 4]) > 0 then
      tenant = tenantOf(ARGV[x + 3], tonumber(ARGV[x + 4]), tonumber(ARGV[x + 5]))
    end
  end
  local longest = earliest
  for i = 1, k do
    local debt = from[i] - now -- refill already promised beyond now
    if debt < 0 then
      debt = 0
    end
    local wait = debt + n[i] / rates[i] * 1000000 - fulls[i]
    if wait > longest and n[i] > 0 and not (days and days[i]) then -- a layer asked nothing is no bar
      longest = wait
    end
  end
  if days then
    longest = dayWait(n, queue, longest, maxWait) -- daily.lua
  end
  local wait = 0
  if longest > 0 then
    wait = math.floor(longest + 0.5)
  end
  -- cost: the take's time at the slowest layer's rate, its tenant's charge.
  local cost, admitted, retry = 0, true, 0
  if tenant then
    for i = 1, k do
      if not (days and days[i]) then -- a day's count is no time
        cost = math.max(cost, n[i] / rates[i] * 1000000)
      end
    end
    if class == 0 and not (forever or resuming) and wait <= maxWait then
      admitted, retry = admit(tenant, cost, wait, tonumber(ARGV[x + 6]) or 0)
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
  end
  local o = (c - 1) * (2 + 2 * k) -- where its reply begins
  if not reply and (outcome ~= GRANTED or wait ~= 0) then
    reply = {}
    for j = 1, o do -- the callers before it, all granted without a wait
      reply[j] = 0
    end
    for j = 1, o, 2 + 2 * k do
      reply[j] = GRANTED
    end
  end
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
    if tenant then
      charge(tenant, cost, class, wait)
      tenant.g = tenant.g + n[1]
    end
    for i = 1, k do
      local v = from[i]
      if days and days[i] then
        v = dayTake(i, queue, n[i], wait) -- daily.lua, which moves queue[i]
      elseif n[i] > 0 then
        local d = n[i] / rates[i] * 1000000
        if class > 0 and queue[i] > now + fulls[i] + commit then
          if not anchor then
            anchor, position = anchorsOf(KEYS, ctl)
          end
          v, queue[i] = push(i, class, from[i], d, queue[i], shares, anchor(i).scale)
          pushed = true
        else
          if at > v then
            v = at
          end
          v = v + d
          if v > queue[i] then
            queue[i] = v
          end
          for lower = 1, class - 1 do
            tails[lower][i] = v
          end
        end
        if class > 0 then
          tails[class][i], classesDirty = v, true
        end
      end
      if reply then
        -- The grant's tat and position (see timeline.lua), for a caller
        -- that sleeps on it; 0 and 0 for one that does not.
        local t, p = 0, 0
        if wait ~= 0 then
          if not anchor then
            anchor, position = anchorsOf(KEYS, ctl)
          end
          t, p = math.floor(v), math.floor(v) - fulls[i]
          if days and days[i] then
            t, p = dayReply(i, v)
          end
          p = math.floor(position(i, p))
        end
        reply[o + 2 + i], reply[o + 2 + k + i] = t, p
      end
    end
  end
end
-- The layers the takes moved, written back as layers.lua's write does
-- (which a plain take does not make); a pause with no end refuses every
-- take.
for i = 1, k do
  local v = queue[i]
  if v == tats[i] then
    -- unmoved
  elseif v <= now then
    redis.call('DEL', KEYS[i])
  else
    set(KEYS[i], v) -- layers.lua's
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
if not reply then
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
