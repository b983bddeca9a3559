# The outbox database: PostgreSQL 15 on a private IP only, reached through the Cloud SQL Auth
# Proxy (GKE sidecar) and Cloud Run's built-in /cloudsql connection. Both binaries' PostgreSQL
# driver is built without TLS, so they cannot connect to the private IP directly with ssl_mode
# ENCRYPTED_ONLY: the proxy paths are the supported ones.

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
  database_version    = "POSTGRES_15"
  deletion_protection = var.deletion_protection

  settings {
    edition           = "ENTERPRISE"
    tier              = var.db_tier
    availability_type = var.db_availability_type
    disk_type         = "PD_SSD"
    disk_size         = var.db_disk_size_gb
    disk_autoresize   = true
    # Also refuse deletion through the API and console, not only through Terraform.
    deletion_protection_enabled = var.deletion_protection

    ip_configuration {
      ipv4_enabled    = false
      private_network = var.network
      # The proxies always use TLS; this refuses anything else.
      ssl_mode = "ENCRYPTED_ONLY"
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
      name  = "log_min_duration_statement"
      value = "1000"
    }
  }

  depends_on = [
    google_project_service.enabled,
    google_service_networking_connection.private_service_access,
  ]
}

resource "google_sql_database" "outbox" {
  name     = var.db_name
  instance = google_sql_database_instance.outbox.name
}

# URL-safe (no special characters): it is embedded as is in the DATABASE_URL secrets.
resource "random_password" "db" {
  length  = 32
  special = false
}

resource "google_sql_user" "outbox" {
  name     = var.db_user
  instance = google_sql_database_instance.outbox.name
  password = random_password.db.result
  # The user owns the schema the migrations create, and PostgreSQL refuses to drop a role that
  # owns objects: on destroy, leave it to go with the instance.
  deletion_policy = "ABANDON"
}
