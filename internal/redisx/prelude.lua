-- quota: the prelude of every script of the package, which NewScript puts
-- before the script's own source.
--
-- clock(arg) returns now in microseconds: arg, the callers' clock, when it
-- is a number, and the server's TIME otherwise (an empty ARGV).
local function clock(arg)
  if arg ~= '' then
    local now = tonumber(arg)
    if now then
      return now
    end
  end
  if not redis.REDIS_VERSION_NUM and redis.replicate_commands then
    redis.replicate_commands() -- lets TIME precede writes on Redis < 5 (7, which has REDIS_VERSION_NUM, has no other mode)
  end
  local t = redis.call('TIME')
  return t[1] * 1000000 + t[2]
end

