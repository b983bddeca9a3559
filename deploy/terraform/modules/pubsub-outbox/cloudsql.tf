# The outbox database: PostgreSQL (var.postgres_version) on a private IP only, reached only through
# the Cloud SQL Auth Proxy (a sidecar of the dispatcher, the migration Job and the producer job).
# The proxy presents an ephemeral client certificate (the instance requires one and refuses other
# connectors) and logs in with the workload's IAM identity (--auto-iam-authn): no database
# password exists anywhere, in Terraform state or in Kubernetes.

resource "google_compute_global_address" "private_service_access" {
  count = var.create_private_service_access ? 1 : 0

  name          = "${var.name_prefix}-psa"
  purpose       = "VPC_PEERING"
  address_type  = "INTERNAL"
  prefix_length = var.private_service_access_prefix_length
  network       = var.network

  depends_on = [google_project_service.enabled]
}

resource "google_service_networking_connection" "private_service_access" {
  count = var.create_private_service_access ? 1 : 0

  network                 = var.network
  service                 = "servicenetworking.googleapis.com"
  reserved_peering_ranges = [google_compute_global_address.private_service_access[0].name]
}

resource "google_sql_database_instance" "outbox" {
  name                = "${var.name_prefix}-pg"
  region              = var.region
  database_version    = var.postgres_version
  deletion_protection = var.deletion_protection
  # Optional CMEK (var.kms_key_name); the Cloud SQL service agent is granted the key first (kms.tf).
  encryption_key_name = var.kms_key_name

  settings {
    edition           = "ENTERPRISE"
    tier              = var.db_tier
    availability_type = var.db_availability_type
    disk_type         = "PD_SSD"
    disk_size         = var.db_disk_size_gb
    disk_autoresize   = true
    # Also refuse deletion through the API and console, not only through Terraform.
    deletion_protection_enabled = var.deletion_protection
    # Only the Cloud SQL connectors (the Auth Proxy) may connect: no direct connection to the
    # private IP, whatever the credentials.
    connector_enforcement = "REQUIRED"

    ip_configuration {
      ipv4_enabled    = false
      private_network = var.network
      # TLS with a client certificate issued by the instance's CA: the proxy presents an
      # ephemeral one on every connection, anything else is refused.
      ssl_mode = "TRUSTED_CLIENT_CERTIFICATE_REQUIRED"
    }

    backup_configuration {
      enabled                        = true
      point_in_time_recovery_enabled = true
      start_time                     = "02:00"
      transaction_log_retention_days = 7
      backup_retention_settings {
        retained_backups = 14
      }
    }

    maintenance_window {
      day          = 7 # Sunday
      hour         = 3
      update_track = "stable"
    }

    # Slow queries are found here, by normalized query shape, without their parameters (the
    # payloads): that is why log_min_duration_statement is off below.
    insights_config {
      query_insights_enabled  = true
      record_application_tags = false
      record_client_address   = false
    }

    # Flags for a queue workload. Deliberately NOT set here:
    # - idle_in_transaction_session_timeout: the dispatcher sets it per session from
    #   OUTBOX_LOCK_TIMEOUT (a claim held by a hung dispatcher is ended and its rows freed). A
    #   global value would also cut the producer's and operators' sessions.
    # - synchronous_commit: the dispatcher turns it off for its own sessions only (a lost commit
    #   re-publishes, which consumers dedupe); the producer keeps durable commits.
    # - log_duration, log_hostname: a log line per statement (thousands per second), and a
    #   reverse DNS lookup per connection for addresses that are always the proxy's.
    database_flags {
      # IAM database authentication: the workloads' service accounts are database users.
      name  = "cloudsql.iam_authentication"
      value = "on"
    }
    database_flags {
      name  = "max_connections"
      value = tostring(var.db_max_connections)
    }
    database_flags {
      # The migration gives pubsub_outbox fixed per-table vacuum thresholds (every insert is later
      # a delete); they only help if the launcher looks often. Default 60s.
      name  = "autovacuum_naptime"
      value = "10"
    }
    database_flags {
      # Dead rows at the head of the queue slow every claim; see whether vacuum keeps up.
      name  = "log_autovacuum_min_duration"
      value = "10000"
    }
    database_flags {
      name  = "log_lock_waits"
      value = "on"
    }
    database_flags {
      name  = "log_checkpoints"
      value = "on"
    }
    database_flags {
      # Who connected and for how long; no statement text.
      name  = "log_connections"
      value = "on"
    }
    database_flags {
      name  = "log_disconnections"
      value = "on"
    }
    database_flags {
      # NEVER raise this to mod or all, and never set log_min_duration_statement: both write
      # statements WITH their bind parameters to Cloud Logging, i.e. the outbox payloads of every
      # INSERT and claim. ddl logs schema changes only (never ALTER ROLE … PASSWORD in SQL; use
      # `gcloud sql users set-password`, which keeps the password out of statements).
      name  = "log_statement"
      value = "ddl"
    }
    database_flags {
      # Explicitly off (-1, the default): see log_statement above. Query Insights covers slow
      # queries without their data.
      name  = "log_min_duration_statement"
      value = "-1"
    }
    database_flags {
      # The default, spelled out: a failing statement's text is logged (placeholders, not bind
      # parameters: log_parameter_max_length_on_error stays at its default 0).
      name  = "log_min_error_statement"
      value = "error"
    }
    database_flags {
      # Error reports without their DETAIL, HINT, QUERY and CONTEXT lines. At the default, a
      # check or not-null violation logs "DETAIL: Failing row contains (...)": every column of
      # the row, the payload included (BYTEA, in hex), into Cloud Logging; a unique violation
      # logs the key's value. Terse keeps the ERROR line (the constraint and the table) and the
      # statement's text (with placeholders, see above); it also drops the DETAIL of lock waits
      # and deadlocks (which process holds the lock). Checked on PostgreSQL 15. Only the server
      # log changes: clients still receive the DETAIL. The CIS benchmark (GCP 6.2.1) asks for
      # "default or stricter": terse is stricter.
      name  = "log_error_verbosity"
      value = "terse"
    }
    # Optional pgAudit (var.enable_pgaudit): DDL and role changes only, never parameters.
    dynamic "database_flags" {
      for_each = var.enable_pgaudit ? {
        "cloudsql.enable_pgaudit" = "on"
        "pgaudit.log"             = "ddl,role"
        "pgaudit.log_parameter"   = "off"
      } : {}
      content {
        name  = database_flags.key
        value = database_flags.value
      }
    }
  }

  depends_on = [
    google_project_service.enabled,
    google_service_networking_connection.private_service_access,
    google_kms_crypto_key_iam_member.service_agents,
  ]
}

# The outbox's rows and the producer's watermarks. Renaming db_name would replace it, an empty one
# in its place: prevent_destroy refuses such a plan (and a destroy), and ABANDON leaves the
# database in the instance if it is ever taken out of the state. To really remove it: `terraform
# state rm google_sql_database.outbox`, then `gcloud sql databases delete` (deploy/README.md).
resource "google_sql_database" "outbox" {
  name            = var.db_name
  instance        = google_sql_database_instance.outbox.name
  deletion_policy = "ABANDON"

  lifecycle {
    prevent_destroy = true
  }
}

# One IAM database user per workload (dispatcher, migrate, producer, the in-cluster operator); no
# built-in (password) user is created here. For a service account the PostgreSQL user name is
# its email without ".gserviceaccount.com". IAM users start with no privileges:
# deploy/sql/bootstrap.sql lets the migrator create (and so own) the schema and makes the others
# members of the outbox_dispatcher / outbox_producer / outbox_operator roles (deploy/README.md).
resource "google_sql_user" "workload" {
  for_each = local.db_workloads

  name     = trimsuffix(each.value.email, ".gserviceaccount.com")
  instance = google_sql_database_instance.outbox.name
  type     = "CLOUD_IAM_SERVICE_ACCOUNT"
  # The migrator owns the schema, and PostgreSQL refuses to drop a role that owns objects or
  # holds grants: on destroy, leave the users to go with the instance.
  deletion_policy = "ABANDON"
}

# The operators who log in as themselves (var.operators, var.operator_groups). A person's user
# name is the full email (nothing is dropped, unlike a service account); a group's is the group's
# email, and its members log in as their own emails and inherit what is granted to the group.
# The bootstrap run per name (terraform output database_bootstrap_command) makes each a member of
# outbox_operator. Removing a name deletes the user: an operator owns nothing and holds no
# privilege of its own (only the membership), so PostgreSQL drops it (checked on 15); the audit
# rows keep the name as text.
resource "google_sql_user" "operator" {
  for_each = merge(
    { for email in var.operators : email => "CLOUD_IAM_USER" },
    { for email in var.operator_groups : email => "CLOUD_IAM_GROUP" },
  )

  name     = each.key
  instance = google_sql_database_instance.outbox.name
  type     = each.value
}
