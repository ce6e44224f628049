-- quota: the take from a pool. A pool is several buckets, its deployments,
-- each with limits of its own, any of which may serve a request; their
-- keys share one hash tag, so that a Redis Cluster keeps them in one slot.
-- This script takes one caller's tokens from the deployment that grants
-- them soonest, with the ordinary take (script.lua, which runs here as the
-- function bucket(KEYS, ARGV), see scripts.go), in one atomic call.
--
-- KEYS        each candidate's take KEYS (its layers' keys, then its
--             control record), the candidates one after another.
-- ARGV[1]     "pool".
-- ARGV[2]     now in microseconds, or "" to use the server's clock: every
--             candidate's take runs at this one instant.
-- ARGV[3]     m, the candidates.
-- ARGV[3+c]   candidate c's "<KEYS> <ARGV> <tier>": how many of KEYS and
--             of the ARGV that follow are its take's, and 0 for a
--             deployment of the first tier, 1 for a last resort.
-- ARGV[4+m...] each candidate's take ARGV (script.lua's) for its one
--             caller, in order.
-- It runs as the function pooled(KEYS, ARGV, longest) (see scripts.go):
-- longest, when not nil, is every candidate's longest wait, in place of
-- the one in its ARGV (a slot's hand-off counts down the caller's).
--
-- The choice: the first tier before the last resorts; within a tier,
-- the candidate with the most room relative to its limits first (the
-- least room of its layers as their tats stand, the override and learned
-- rates aside), then the candidates' order. Each, in that order, is taken
-- from if it grants at once (a take with a longest wait of 0, which takes
-- nothing otherwise). When none does, the candidate whose take would
-- grant soonest, the first tier's on a tie, is taken from with the
-- caller's longest wait. A candidate paused until a resume, or resuming
-- after an outage, is chosen only when every one is.
--
-- Reply: {c, ...}, c the candidate taken from (or refused by), then its
-- take's reply (script.lua's) for its one caller.
local m = tonumber(ARGV[3])
if not m or m < 1 then
  return redis.error_reply('quota: a pool of ' .. tostring(ARGV[3]) .. ' candidates')
end
local stamp = string.format('%d', clock(ARGV[2])) -- the prelude's
local cands, key, arg = {}, 0, 3 + m
for c = 1, m do
  local nk, na, tier = string.match(ARGV[3 + c], '^(%d+) (%d+) ([01])$')
  nk, na = tonumber(nk), tonumber(na)
  if not nk or nk < 2 or na < 6 then
    return redis.error_reply('quota: a pool candidate of ' .. tostring(ARGV[3 + c]))
  end
  local keys, argv = {}, {}
  for i = 1, nk do
    keys[i] = KEYS[key + i]
  end
  for i = 1, na do
    argv[i] = ARGV[arg + i]
  end
  argv[2] = stamp
  key, arg = key + nk, arg + na
  -- room: the least share of its burst any layer holds now.
  local now, k, room = tonumber(stamp), nk - 1, 1
  for i = 1, k do
    local rate, burst = tonumber(argv[na - 2 * k + 2 * i - 1]), tonumber(argv[na - 2 * k + 2 * i])
    local tat = tonumber(redis.call('GET', keys[i]))
    if tat and rate and burst and rate > 0 and burst > 0 and tat > now then
      room = math.min(room, 1 - (tat - now) / (burst / rate * 1000000))
    end
  end
  cands[c] = {c = c, keys = keys, argv = argv, tier = tonumber(tier), room = room, wait = longest or argv[5]}
end
if key ~= #KEYS or arg ~= #ARGV then
  return redis.error_reply('quota: a pool of ' .. #KEYS .. ' KEYS and ' .. #ARGV .. ' ARGV')
end
local order = {}
for c = 1, m do
  order[c] = cands[c]
end
table.sort(order, function(a, b)
  if a.tier ~= b.tier then
    return a.tier < b.tier
  end
  if a.room ~= b.room then
    return a.room > b.room
  end
  return a.c < b.c
end)

-- reply prefixes the take's reply r with the candidate c.
local function reply(c, r)
  if type(r) ~= 'table' then
    return {c.c, r}
  end
  if r.err then
    return r
  end
  table.insert(r, 1, c.c)
  return r
end

local best, soonest, blocked
for _, c in ipairs(order) do
  c.argv[5] = '0'
  local r = bucket(c.keys, c.argv)
  if type(r) ~= 'table' or r.err or (r[1] == 1 and r[2] == 0) then
    return reply(c, r) -- granted at once (0 alone), or an error
  end
  if r[1] == 3 or r[1] == 4 then
    blocked = blocked or c -- paused until a resume, or resuming
  elseif not best or r[2] < soonest then
    best, soonest = c, r[2]
  end
end
best = best or blocked
best.argv[5] = best.wait
return reply(best, bucket(best.keys, best.argv))
