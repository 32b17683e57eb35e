output "addresses" {
  description = "Planned IPv4 address by guest name, reserved for its MAC on the host's network."
  value       = module.pgcarve_host.addresses
}

output "emulator_cpus" {
  description = "Host CPUs of each guest's emulator threads, by guest name."
  value       = module.pgcarve_host.emulator_cpus
}

output "guest_names" {
  description = "Names of the guests, in instance index order."
  value       = module.pgcarve_host.guest_names
}

output "ip_addresses" {
  description = "IPv4 addresses by guest name, from DHCP leases (after a refresh)."
  value       = module.pgcarve_host.ip_addresses
}

output "macs" {
  description = "MAC address by guest name."
  value       = module.pgcarve_host.macs
}

output "pinned_cpus" {
  description = "Host CPU of each vCPU, by guest name."
  value       = module.pgcarve_host.pinned_cpus
}

output "roles" {
  description = "Role (primary or standby) each guest was created with, by guest name."
  value       = module.pgcarve_host.roles
}

output "volumes" {
  description = "Disk overlay and seed volume of each guest."
  value       = module.pgcarve_host.volumes
}
