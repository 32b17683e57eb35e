# One libvirt host's share of a pgcarve fleet, laid out as `pgcarve plan --host NAME --format
# tfvars` planned it: the primaries of a primary host, or the standbys of a standby host. The
# guests get the same names, pinned CPUs, NUMA node, MAC, reserved address and <pgcarve:instance>
# metadata as the manager's own, so the manager lists and tracks them (`pgcarve status`, the REST
# API). Their seeds carry what the manager would otherwise do at run time (a standby's primary and
# its own replication slot, a primary's synchronous standbys and replication peers), so the hosts
# can be applied in any order.
#
# The provider is configured by the calling root module (see examples/sandbox).

locals {
  pool = var.create_pool ? libvirt_pool.pgcarve[0].name : var.pool_name

  # The provider takes the kernel command line as maps and reads it back split the same way
  # (key=value words in one map, bare words joined under "_"); the XSLT then writes the exact
  # line. Building the maps like this keeps `terraform plan` empty after an apply.
  cmdline_words   = split(" ", var.kernel_cmdline)
  cmdline_keyed   = { for w in local.cmdline_words : split("=", w)[0] => join("=", slice(split("=", w), 1, length(split("=", w)))) if strcontains(w, "=") }
  cmdline_keyless = join(" ", [for w in local.cmdline_words : w if !strcontains(w, "=")])
  cmdline = concat(
    length(local.cmdline_keyed) > 0 ? [local.cmdline_keyed] : [],
    local.cmdline_keyless != "" ? [{ "_" = local.cmdline_keyless }] : [],
  )

  # Per guest, the stylesheet that turns the provider's domain XML into the manager's.
  xslt = {
    for name, i in var.instances : name => templatefile("${path.module}/domain.xsl.tftpl", {
      cluster       = i.metadata.cluster
      cmdline       = var.kernel_cmdline
      console_log   = var.console_log_dir == "" ? "" : "${var.console_log_dir}/${name}-console.log"
      created_by    = i.metadata.created_by
      domain_type   = var.domain_type
      emulator_cpus = i.emulator_cpus
      fleet         = i.metadata.fleet
      hugepages     = i.hugepages
      index         = i.metadata.index
      memory_mib    = i.memory_mib
      name          = name
      numa_node     = i.numa_node
      role          = i.metadata.role
      roles         = i.metadata.roles
      standby       = i.metadata.standby
      vcpu_pins     = i.vcpu_pins
    })
  }
}

resource "libvirt_pool" "pgcarve" {
  count = var.create_pool ? 1 : 0

  name = var.pool_name
  type = "dir"
  path = var.pool_path
}

# The image, uploaded once per image tag. The names differ from the manager's
# pgcarve-base-<tag>.qcow2 / pgcarve-vmlinuz-<tag> / pgcarve-initrd-<tag>, so neither side
# ever deletes or overwrites a volume the other one uses.
resource "libvirt_volume" "base" {
  name   = "pgcarve-tf-base-${var.image.tag}.qcow2"
  pool   = local.pool
  source = var.image.base_path
  format = "qcow2"
}

resource "libvirt_volume" "kernel" {
  name   = "pgcarve-tf-vmlinuz-${var.image.tag}"
  pool   = local.pool
  source = var.image.kernel_path
  format = "raw"
}

resource "libvirt_volume" "initrd" {
  name   = "pgcarve-tf-initrd-${var.image.tag}"
  pool   = local.pool
  source = var.image.initrd_path
  format = "raw"
}

# Each guest's disk: a qcow2 overlay on the base volume (O(1) in the image size), named as the
# manager names it, so `pgcarve down` would remove it too.
resource "libvirt_volume" "disk" {
  for_each = var.instances

  name           = "${each.key}.qcow2"
  pool           = local.pool
  base_volume_id = libvirt_volume.base.id
  format         = "qcow2"
  size           = each.value.disk_gib * 1024 * 1024 * 1024
}

# The NoCloud seed (ISO 9660, label "cidata", built by the provider with mkisofs).
resource "libvirt_cloudinit_disk" "seed" {
  for_each = var.instances

  name      = "${each.key}-seed.iso"
  pool      = local.pool
  user_data = var.seeds[each.key].user_data
  meta_data = var.seeds[each.key].meta_data

  lifecycle {
    # The guest reads its seed on first boot. pgcarve renders fresh SCRAM salts on every
    # `pgcarve plan`, which must not replace running databases' seeds.
    ignore_changes = [user_data, meta_data]

    precondition {
      condition     = contains(nonsensitive(keys(var.seeds)), each.key)
      error_message = "var.seeds has no seed for this instance."
    }
  }
}

# Primaries and standbys alike: metadata.role says which, and the manager reads it from libvirt.
resource "libvirt_domain" "guest" {
  for_each = var.instances

  name      = each.key
  type      = var.domain_type
  arch      = "x86_64"
  machine   = "pc"
  memory    = each.value.memory_mib
  vcpu      = length(each.value.vcpu_pins)
  autostart = true

  kernel  = libvirt_volume.kernel.id
  initrd  = libvirt_volume.initrd.id
  cmdline = local.cmdline

  dynamic "cpu" {
    for_each = var.domain_type == "kvm" ? [1] : []
    content {
      mode = "host-passthrough"
    }
  }

  disk {
    volume_id = libvirt_volume.disk[each.key].id
  }

  # Attached as a plain disk (vdb), not through the `cloudinit` argument: 0.7.6 attaches that
  # as an IDE cdrom, which the Debian cloud kernel cannot see. The id is "<volume key>;<uuid>".
  disk {
    volume_id = split(";", libvirt_cloudinit_disk.seed[each.key].id)[0]
  }

  # With addresses set, the provider reserves the address for the MAC in the network's DHCP
  # server (live and in its stored definition) before it defines the domain. It never removes
  # the reservation: terraform destroy leaves it (see README.md).
  network_interface {
    network_name   = var.network_name
    mac            = each.value.mac
    addresses      = [each.value.address]
    wait_for_lease = var.wait_for_lease
  }

  xml {
    xslt = local.xslt[each.key]
  }

  lifecycle {
    # The provider reads addresses back from the network's leases: empty until the guest has
    # booted far enough to ask for one, and whenever it is stopped. Without this, `terraform plan`
    # would show an update in place then, and applying it starts a stopped guest. The address
    # is reserved when the domain is created; the planner never moves it.
    ignore_changes = [network_interface[0].addresses]
  }
}

# Named "primary" while the module laid out primaries only: states from then keep their domains.
moved {
  from = libvirt_domain.primary
  to   = libvirt_domain.guest
}
