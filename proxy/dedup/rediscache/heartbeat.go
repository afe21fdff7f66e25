package rediscache

import (
	"context"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// The heartbeat is one pipelined round trip every PresenceTTL/3, from Open
// to Close, that
//   - refreshes this instance's presence key, so that waiters elsewhere can
//     tell a leader that is slow from one that is gone and take over the
//     flights of the latter within PresenceTTL instead of a whole Lease;
//   - reads the fleet's epoch, a random value set once and kept for as long
//     as Redis keeps its data: a new one means Redis lost what it held
//     (restarted without persistence, failed over to an empty replica,
//     flushed), so the copies this instance holds in memory from before
//     are given back to the fleet rather than fetched again;
//   - goes through the breaker, so that an idle instance learns that Redis
//     went away, or came back, as soon as a busy one: Available follows
//     Redis, not the traffic. While the breaker is open the beats cost
//     nothing; the first one after breaker_interval is its probe.
//
// A presence key outlives one or two missed beats: only an instance that
// cannot reach Redis for PresenceTTL looks gone (and then its flights could
// not finish through Redis anyway).

func (c *client) presenceKey(instance string) string { return c.prefix + "live:" + instance }
func (c *client) epochKey() string                   { return c.prefix + "epoch" }

// heartbeat beats until Close.
func (c *client) heartbeat() {
	defer c.bg.Done()
	t := time.NewTicker(c.cfg.PresenceTTL / 3)
	defer t.Stop()
	for {
		select {
		case <-c.life.Done():
			c.leave()
			return
		case <-t.C:
			_ = c.beat(c.life)
		case <-c.kick:
			_ = c.beat(c.life)
		}
	}
}

// beat refreshes the presence key and reads the epoch.
func (c *client) beat(ctx context.Context) error {
	sent := time.Now()
	err := c.probe(ctx, func(ctx context.Context) error {
		var epoch *redis.StringCmd
		_, err := c.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			p.Set(ctx, c.presenceKey(c.instance), "1", c.cfg.PresenceTTL)
			// A fresh candidate each time: if Redis lost the epoch, the
			// one that replaces it must differ from every earlier one.
			p.SetNX(ctx, c.epochKey(), randomHex(8), 0)
			epoch = p.Get(ctx, c.epochKey())
			return nil
		})
		if err != nil {
			return err
		}
		// Before the breaker hears of the success: no request can see
		// Redis back before a loss of its data is known.
		c.sawEpoch(epoch.Val(), sent)
		c.presentUntil.Store(sent.Add(c.cfg.PresenceTTL).UnixNano())
		return nil
	})
	if err != nil {
		c.presentUntil.Store(0)
	}
	return err
}

// sawEpoch notes the fleet's epoch as read by a beat sent at t. A change
// means Redis lost its data after the previous beat: what this process
// holds from before t is older than the loss.
func (c *client) sawEpoch(epoch string, t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.epoch != "" && epoch != c.epoch {
		c.lostAt.Store(t.UnixNano())
		c.log.Warn("redis lost its data (restart, failover or flush): copies held in memory are given back to the fleet as they are asked for")
	}
	c.epoch = epoch
}

// lostBefore reports whether something stored at t predates the last time
// Redis was seen to lose its data.
func (c *client) lostBefore(t time.Time) bool {
	lost := c.lostAt.Load()
	return lost != 0 && t.UnixNano() < lost
}

// leave deletes the presence key on the way out: flights this process
// still held (none, after a graceful drain) are taken over at once.
func (c *client) leave() {
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.Timeout)
	defer cancel()
	_ = c.exec(ctx, func(ctx context.Context) error { return c.rdb.Del(ctx, c.presenceKey(c.instance)).Err() })
}

// Tokens name one lock held by this process (a flight's lease, a claim):
// only its holder may release it. "<instance>.<n>" says that the holder
// keeps a presence key, so a waiter may take the flight over once that key
// has lapsed; "<instance>-<n>" (minted while this process's presence is not
// confirmed, or by an older version) is taken over only when the lease
// lapses.
func (c *client) newToken() string {
	sep := "-"
	if time.Now().UnixNano() < c.presentUntil.Load() {
		sep = "."
	}
	return c.instance + sep + strconv.FormatUint(c.seq.Add(1), 36)
}

// holderOf returns the instance that holds token, when the token says that
// instance keeps a presence key. token was read from Redis: anything that
// does not look like one of ours is "no presence", never an error.
func holderOf(token string) (instance string, ok bool) {
	instance, _, ok = strings.Cut(token, ".")
	if !ok || instance == "" || len(instance) > 64 {
		return "", false
	}
	return instance, true
}
