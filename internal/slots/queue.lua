-- own returns where a take's own ARGV (script.lua's) begin in argv, less
-- one: 0, or for a pool's take past its candidates', the first
-- candidate's, whose class and longest wait are every candidate's.
local function own(argv)
  if argv[1] == 'pool' then
    return 3 + (tonumber(argv[3]) or 0)
  end
  return 0
end

-- classOf returns the priority class of the take t (nil: 0): its first
-- caller's, ARGV[6], in the forms that name one (see script.lua).
local function classOf(t)
  local o = t and t.argv and own(t.argv)
  if o and (t.argv[o + 3] == 'class' or t.argv[o + 3] == 'tenant') then
    return tonumber(t.argv[o + 6]) or 0
  end
  return 0
end

-- entry returns the queue's entry for id, a waiter of class c.
local function entry(id, c)
  if c > 0 then
    return id .. '@' .. c
  end
  return id
end

-- enqueue puts id, a waiter of class c, at the end of its class in the
-- queue: ahead of the first waiter of a lower class.
local function enqueue(id, c)
  if c > 0 then
    local entries = redis.call('LRANGE', queue, 0, -1)
    for _, e in ipairs(entries) do
      local ec = tonumber(string.match(e, '@([1-7])$')) or 0
      if ec < c then
        redis.call('LINSERT', queue, 'BEFORE', e, entry(id, c))
        return
      end
    end
  end
  redis.call('RPUSH', queue, entry(id, c))
end

-- queuedClass returns the class id queues at, from the take it left.
local function queuedClass(id)
  local t = redis.call('HGET', takes, id)
  if t and string.sub(t, 1, 1) == '{' then
    return classOf(cjson.decode(t))
  end
  return 0
end

