# The variables `pgcarve plan --format tfvars` writes. Everything but libvirt_uri is passed to the
# module unchanged; see ../../variables.tf for their validation.

variable "create_pool" {
  type        = bool
  description = "Create the storage pool instead of using the existing one (see the module)."
  default     = false
}

variable "domain_type" {
  type        = string
  description = "libvirt domain type, kvm or qemu (pgcarve writes the host's probed type)."
  default     = "kvm"
}

variable "image" {
  type = object({
    base_path   = string
    initrd_path = string
    kernel_path = string
    tag         = string
  })
  description = "The guest image files on this machine and their tag (the content of image.tag)."
}

variable "instances" {
  type = map(object({
    address       = string
    disk_gib      = number
    emulator_cpus = list(number)
    hugepages     = bool
    mac           = string
    memory_mib    = number
    metadata = object({
      cluster    = string
      created_by = string
      fleet      = string
      index      = number
      role       = string
      roles      = optional(string)
      standby    = number
    })
    numa_node = optional(number)
    vcpu_pins = list(number)
  }))
  description = "The guests to create, keyed by guest name, as planned by pgcarve: primaries on a primary host, standbys on a standby host."
}

variable "kernel_cmdline" {
  type        = string
  description = "Kernel command line of every guest."
  default     = "root=/dev/vda rw console=ttyS0 quiet systemd.show_status=0"
}

variable "libvirt_uri" {
  type        = string
  description = "libvirt URI of the host, as in hosts.yaml (a sandbox host: qemu+unix:///system?socket=...)."
  default     = "qemu:///system"

  validation {
    condition     = can(regex("^[a-z][a-z0-9+]*://", var.libvirt_uri))
    error_message = "libvirt_uri must be a libvirt URI such as qemu:///system."
  }
}

variable "network_name" {
  type        = string
  description = "Existing libvirt network for the guests."
  default     = "pgcarve"
}

variable "pool_name" {
  type        = string
  description = "Storage pool for the image and guest volumes."
  default     = "pgcarve"
}

variable "pool_path" {
  type        = string
  description = "Directory of the pool, used when create_pool is true."
  default     = "/var/lib/libvirt/pgcarve"
}

variable "seeds" {
  type = map(object({
    meta_data = string
    user_data = string
  }))
  description = "NoCloud seed (user_data, meta_data) per instance name, rendered by pgcarve."
  sensitive   = true
}

variable "wait_for_lease" {
  type        = bool
  description = "Wait in apply until each guest has a DHCP lease."
  default     = false
}
