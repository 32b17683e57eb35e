output "addresses" {
  description = "Planned IPv4 address of each guest, by name: reserved for its MAC in the network's DHCP server, so the guest always gets it."
  value       = { for name, i in var.instances : name => i.address }
}

output "base_volume" {
  description = "Name of the base image volume the guests' overlays are backed by."
  value       = libvirt_volume.base.name
}

output "domain_ids" {
  description = "libvirt domain UUID of each guest, by name."
  value       = { for name, d in libvirt_domain.guest : name => d.id }
}

output "emulator_cpus" {
  description = "Host CPUs each guest's emulator threads are pinned to, by name."
  value       = { for name, i in var.instances : name => i.emulator_cpus }
}

output "guest_names" {
  description = "Names of the guests (libvirt domains), in instance index order."
  value       = [for i in sort([for name, inst in var.instances : format("%08d %s", inst.metadata.index, name)]) : split(" ", i)[1]]
}

output "ip_addresses" {
  description = "IPv4 addresses from the network's DHCP leases, by name, as of the last refresh (empty until a guest has its lease, or while it is stopped); compare with addresses."
  value       = { for name, d in libvirt_domain.guest : name => flatten([for nic in d.network_interface : nic.addresses]) }
}

output "macs" {
  description = "MAC address of each guest's NIC, by name."
  value       = { for name, i in var.instances : name => i.mac }
}

output "numa_nodes" {
  description = "NUMA node each guest's memory is bound to, by name (null: unbound)."
  value       = { for name, i in var.instances : name => i.numa_node }
}

output "pinned_cpus" {
  description = "Host CPU of each vCPU (vCPU k runs on element k), by name: the same slots `pgcarve plan` reports."
  value       = { for name, i in var.instances : name => i.vcpu_pins }
}

output "roles" {
  description = "Role each guest was created with, by name: \"primary\" or \"standby\" (after a failover the manager's metadata may say otherwise; see README.md)."
  value       = { for name, i in var.instances : name => i.metadata.role }
}

output "volumes" {
  description = "Volumes of each guest in the pool (disk overlay and seed), by name."
  value = {
    for name, d in libvirt_volume.disk : name => {
      disk = d.name
      pool = d.pool
      seed = libvirt_cloudinit_disk.seed[name].name
    }
  }
}
