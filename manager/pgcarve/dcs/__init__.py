"""The DCS: etcd, where Patroni keeps its leader keys (and, later, the managers their lease and
state). `etcd` is the only module that speaks to it; `health` decides what its answers mean;
`watch` polls it for /metrics."""
