//go:build race

package fleet_test

// shardTestProxies is the fleet of TestShards_tenReplicas under the race
// detector.
const shardTestProxies = 10_000
