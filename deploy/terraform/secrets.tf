# Secret Manager: the producer's streams file (mounted into the job as a file) and the two
# DATABASE_URLs, one per way of reaching Cloud SQL.

locals {
  # Cloud Run: the /cloudsql volume's Unix socket (sqlx reads a host= starting with "/" as the
  # socket directory; the socket is <dir>/.s.PGSQL.5432). The hop is encrypted by Cloud Run's proxy.
  producer_database_url = format(
    "postgres://%s:%s@localhost/%s?host=/cloudsql/%s",
    var.db_user, random_password.db.result, var.db_name,
    google_sql_database_instance.outbox.connection_name,
  )
  # GKE: the Cloud SQL Auth Proxy sidecar on 127.0.0.1:5432; it encrypts the hop to Cloud SQL.
  dispatcher_database_url = format(
    "postgres://%s:%s@127.0.0.1:5432/%s?sslmode=disable",
    var.db_user, random_password.db.result, var.db_name,
  )
}

# Not secret, but Secret Manager is how Cloud Run mounts a file into a job. A new version per
# change of the file; the job reads "latest" at each execution.
resource "google_secret_manager_secret" "producer_streams" {
  secret_id = "${var.name_prefix}-producer-streams"
  replication {
    auto {}
  }
  depends_on = [google_project_service.enabled]
}

resource "google_secret_manager_secret_version" "producer_streams" {
  secret      = google_secret_manager_secret.producer_streams.id
  secret_data = file(var.producer_config_file)
}

resource "google_secret_manager_secret" "producer_database_url" {
  secret_id = "${var.name_prefix}-producer-database-url"
  replication {
    auto {}
  }
  depends_on = [google_project_service.enabled]
}

resource "google_secret_manager_secret_version" "producer_database_url" {
  secret      = google_secret_manager_secret.producer_database_url.id
  secret_data = local.producer_database_url
  # Never publish a URL whose user or database does not exist yet.
  depends_on = [google_sql_user.outbox, google_sql_database.outbox]
}

# Read by whoever creates the Kubernetes Secret (deploy/k8s/secret.example.yaml) or by a secret
# sync (External Secrets, the Secret Manager add-on); the dispatcher's own identity needs no access.
resource "google_secret_manager_secret" "dispatcher_database_url" {
  secret_id = "${var.name_prefix}-dispatcher-database-url"
  replication {
    auto {}
  }
  depends_on = [google_project_service.enabled]
}

resource "google_secret_manager_secret_version" "dispatcher_database_url" {
  secret      = google_secret_manager_secret.dispatcher_database_url.id
  secret_data = local.dispatcher_database_url
  # Never publish a URL whose user or database does not exist yet.
  depends_on = [google_sql_user.outbox, google_sql_database.outbox]
}
