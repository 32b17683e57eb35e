variable "console_log_dir" {
  type        = string
  description = "Directory on the libvirt host where each guest's serial console is logged as <name>-console.log (as the manager does). Empty: no console log."
  default     = "/var/log/libvirt/qemu"

  validation {
    condition     = var.console_log_dir == "" || can(regex("^/[A-Za-z0-9_./-]*$", var.console_log_dir))
    error_message = "console_log_dir must be empty or an absolute path of letters, digits, '_', '.', '-' and '/'."
  }
}

variable "create_pool" {
  type        = bool
  description = "Create the storage pool (a dir pool at pool_path) instead of using an existing one. Leave false on hosts the pgcarve manager also uses: the pool is shared with it, and a pool Terraform created is deleted by terraform destroy."
  default     = false
}

variable "domain_type" {
  type        = string
  description = "libvirt domain type: kvm on hosts where KVM really boots guests, qemu (TCG emulation) elsewhere. pgcarve writes what Fleet.domain_type() decided for the host."
  default     = "kvm"

  validation {
    condition     = contains(["kvm", "qemu"], var.domain_type)
    error_message = "domain_type must be kvm or qemu."
  }
}

variable "image" {
  type = object({
    base_path   = string
    initrd_path = string
    kernel_path = string
    tag         = string
  })
  description = "The guest image built by images/build.sh, as files on the machine running terraform (uploaded through libvirt), and its tag: the content of image.tag, which names the build (its inputs and its data directory's identity). The tag is part of the volume names, so a rebuilt image is uploaded beside the old one."

  validation {
    condition     = can(regex("^[0-9a-f]{12}$", var.image.tag))
    error_message = "image.tag must be 12 lower-case hex digits (the content of the image directory's image.tag)."
  }

  validation {
    condition = alltrue([
      for p in [var.image.base_path, var.image.initrd_path, var.image.kernel_path] : startswith(p, "/")
    ])
    error_message = "image.base_path, image.initrd_path and image.kernel_path must be absolute paths."
  }
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
  description = "The guests to create, keyed by guest name, as planned by `pgcarve plan --host NAME --format tfvars`: primaries on a primary host, standbys on a standby host (at most one guest per instance on a host). vCPU k is pinned to host CPU vcpu_pins[k], emulator threads to emulator_cpus, memory bound to numa_node (null: unbound). address is the guest's planned IPv4 address, reserved for its MAC in the network's DHCP server (other guests' seeds name it). metadata is the <pgcarve:instance> element the manager reads back: role primary (standby 0, keyed by its instance's name, metadata.cluster) or standby (standby 1-4, keyed <cluster>-s<standby>); roles is who decides the instance's roles, manager or patroni (left out, as in variables planned by an earlier release: the manager)."

  validation {
    condition     = alltrue([for name, i in var.instances : can(regex("^[a-z][a-z0-9-]{0,62}$", name))])
    error_message = "Instance names must be lower-case letters, digits and '-', starting with a letter, at most 63 characters."
  }

  validation {
    condition = alltrue([
      for i in values(var.instances) : length(i.vcpu_pins) > 0 && length(i.emulator_cpus) > 0 && alltrue([
        for c in concat(i.vcpu_pins, i.emulator_cpus) : c >= 0 && floor(c) == c
      ])
    ])
    error_message = "Every instance needs at least one vCPU pin and one emulator CPU; host CPU ids are integers >= 0."
  }

  validation {
    condition = alltrue([
      for i in values(var.instances) : length(distinct(i.vcpu_pins)) == length(i.vcpu_pins)
    ]) && length(distinct(flatten([for i in values(var.instances) : i.vcpu_pins]))) == length(flatten([for i in values(var.instances) : i.vcpu_pins]))
    error_message = "A host CPU may be pinned to only one vCPU of one instance."
  }

  validation {
    condition = alltrue([
      for i in values(var.instances) : i.memory_mib >= 128 && i.memory_mib <= 4194304 && floor(i.memory_mib) == i.memory_mib && i.disk_gib >= 2 && floor(i.disk_gib) == i.disk_gib
    ])
    error_message = "memory_mib must be an integer from 128 to 4194304 and disk_gib an integer >= 2."
  }

  validation {
    condition     = alltrue([for i in values(var.instances) : i.numa_node == null ? true : i.numa_node >= 0 && floor(i.numa_node) == i.numa_node])
    error_message = "numa_node must be null or an integer >= 0."
  }

  validation {
    condition     = alltrue([for i in values(var.instances) : can(regex("^52:54:00(:[0-9a-f]{2}){3}$", i.mac))])
    error_message = "mac must be a lower-case 52:54:00:xx:xx:xx address."
  }

  validation {
    condition     = length(distinct([for i in values(var.instances) : i.mac])) == length(var.instances)
    error_message = "Two instances have the same MAC address."
  }

  validation {
    condition = alltrue([
      for i in values(var.instances) : can(regex("^((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])$", i.address))
    ])
    error_message = "address must be a plain IPv4 address: four decimal numbers 0-255 without leading zeros, separated by dots (no prefix length, no port)."
  }

  validation {
    condition     = length(distinct([for i in values(var.instances) : i.address])) == length(var.instances)
    error_message = "Two instances have the same address: a host's network reserves each address for one guest."
  }

  validation {
    condition     = alltrue([for i in values(var.instances) : contains(["primary", "standby"], i.metadata.role)])
    error_message = "metadata.role must be \"primary\" or \"standby\"."
  }

  validation {
    condition     = alltrue([for i in values(var.instances) : i.metadata.roles == null ? true : contains(["manager", "patroni"], i.metadata.roles)])
    error_message = "metadata.roles must be \"manager\" or \"patroni\" (who decides the instance's roles; left out, as in variables planned by an earlier release: the manager)."
  }

  validation {
    condition = alltrue([
      for i in values(var.instances) : i.metadata.created_by == "terraform" && can(regex("^[a-z][a-z0-9]{0,15}$", i.metadata.fleet)) && i.metadata.index >= 1 && floor(i.metadata.index) == i.metadata.index
    ])
    error_message = "metadata needs created_by \"terraform\", a fleet name of 1-16 lower-case letters and digits starting with a letter, and an integer index >= 1."
  }

  validation {
    condition = alltrue([
      for i in values(var.instances) : try(i.metadata.cluster == format("%s-%02d", i.metadata.fleet, i.metadata.index), false)
    ])
    error_message = "metadata.cluster must be the instance's name: <fleet>-<index>, the index written with at least two digits (pgc-01)."
  }

  validation {
    condition = alltrue([
      for name, i in var.instances : i.metadata.role != "primary" || (i.metadata.standby == 0 && name == i.metadata.cluster)
    ])
    error_message = "A primary must have metadata.standby 0 and be keyed by its instance's name (metadata.cluster)."
  }

  validation {
    condition = alltrue([
      for name, i in var.instances : i.metadata.role != "standby" || (
        i.metadata.standby >= 1 && i.metadata.standby <= 4 && floor(i.metadata.standby) == i.metadata.standby &&
        try(name == format("%s-s%d", i.metadata.cluster, i.metadata.standby), false)
      )
    ])
    error_message = "A standby must have metadata.standby from 1 to 4 (its number; an instance has at most 4 standbys) and be keyed by <cluster>-s<standby> (pgc-01-s1), never by the instance's name."
  }

  validation {
    condition     = length(distinct([for i in values(var.instances) : i.metadata.index])) == length(var.instances)
    error_message = "Two instances have the same metadata.index: a host holds at most one guest (primary or standby) of each instance."
  }
}

variable "kernel_cmdline" {
  type        = string
  description = "Kernel command line of every guest (direct kernel boot), the same as the manager's DomainSpec.cmdline."
  default     = "root=/dev/vda rw console=ttyS0 quiet systemd.show_status=0"

  validation {
    condition     = can(regex("^[A-Za-z0-9_./:=,+-]+( [A-Za-z0-9_./:=,+-]+)*$", var.kernel_cmdline))
    error_message = "kernel_cmdline must be words of letters, digits and _./:=,+- separated by single spaces."
  }

  validation {
    condition = length([for a in split(" ", var.kernel_cmdline) : a if strcontains(a, "=")]) == length(distinct([
      for a in split(" ", var.kernel_cmdline) : split("=", a)[0] if strcontains(a, "=")
    ]))
    error_message = "kernel_cmdline must not set the same key=value parameter twice (the provider could not read it back unchanged)."
  }
}

variable "network_name" {
  type        = string
  description = "Existing libvirt network the guests' virtio NIC joins (the pgcarve sandbox defines \"pgcarve\" on each host). It needs an IPv4 DHCP range: each guest's planned address is reserved there for its MAC, and the reservation outlives terraform destroy."
  default     = "pgcarve"

  validation {
    condition     = can(regex("^[A-Za-z0-9_.-]{1,64}$", var.network_name))
    error_message = "network_name must be 1-64 letters, digits, '_', '.' or '-'."
  }
}

variable "pool_name" {
  type        = string
  description = "Storage pool for the image and guest volumes (the manager's pool of this host in hosts.yaml)."
  default     = "pgcarve"

  validation {
    condition     = can(regex("^[A-Za-z0-9_.-]{1,64}$", var.pool_name))
    error_message = "pool_name must be 1-64 letters, digits, '_', '.' or '-'."
  }
}

variable "pool_path" {
  type        = string
  description = "Directory of the pool on the libvirt host; used only when create_pool is true."
  default     = "/var/lib/libvirt/pgcarve"

  validation {
    condition     = startswith(var.pool_path, "/")
    error_message = "pool_path must be an absolute path."
  }
}

variable "seeds" {
  type = map(object({
    meta_data = string
    user_data = string
  }))
  description = "NoCloud seed per instance name: user_data (\"#cloud-config\" then JSON carrying /etc/pgcarve/instance.json with SCRAM verifiers for the roles, the guest's TLS key and certificate, and on a standby its instance's replication password in clear, which it logs in to its primary with: keep the variables file 0600) and meta_data (JSON), rendered by pgcarve with the fleet's and the instance's credentials. Read by the guest on first boot only: later changes are ignored (replace the guest to re-seed it)."
  sensitive   = true

  validation {
    condition     = alltrue([for s in values(var.seeds) : startswith(s.user_data, "#cloud-config\n") && can(jsondecode(s.meta_data))])
    error_message = "Each seed needs user_data starting with \"#cloud-config\" and a line break, and JSON meta_data."
  }
}

variable "wait_for_lease" {
  type        = bool
  description = "Make terraform apply wait until each guest has a DHCP lease on the network (PostgreSQL may still be starting then)."
  default     = false
}
