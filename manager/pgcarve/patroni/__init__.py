"""Patroni, as the manager sees it: `view` reads what its keys in etcd say (pure), `store` fetches
them (one etcd request for one scope or for all) and deletes a purged instance's, `rest` commands
a member through its REST API. Patroni decides roles; pgcarve reads and asks."""
