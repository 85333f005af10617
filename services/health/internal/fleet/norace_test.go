//go:build !race

package fleet_test

// shardTestProxies is the fleet of TestShards_tenReplicas.
const shardTestProxies = 100_000
