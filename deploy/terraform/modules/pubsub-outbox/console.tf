# The operator console on GKE (deploy/k8s/console), when console_enabled: its own identity (a
# member of outbox_operator in the database, through the bootstrap line it adds to
# database_bootstrap_command; no Pub/Sub, BigQuery or secret rights), the global address of its
# Ingress, and who may pass Identity-Aware Proxy to it (console_users).

resource "google_service_account" "console" {
  count = var.console_enabled ? 1 : 0

  account_id   = "${var.name_prefix}-console"
  display_name = "pubsub-outbox operator console (GKE, Workload Identity, behind IAP)"
  depends_on   = [google_project_service.enabled]
}

# Pods running as the console's Kubernetes service account act as it.
resource "google_service_account_iam_member" "console_workload_identity" {
  count = var.console_enabled ? 1 : 0

  service_account_id = google_service_account.console[0].name
  role               = "roles/iam.workloadIdentityUser"
  member             = local.console_workload_identity_member
}

# The Ingress's address (its kubernetes.io/ingress.global-static-ip-name annotation names it).
resource "google_compute_global_address" "console" {
  count = var.console_enabled ? 1 : 0

  name       = "${var.name_prefix}-console"
  depends_on = [google_project_service.enabled]

  lifecycle {
    # A console nobody may open is a mistake: name its users, or leave it off.
    precondition {
      condition     = length(var.console_users) > 0
      error_message = "console_enabled needs console_users (\"user:EMAIL\" or \"group:EMAIL\"): IAP lets nobody else in."
    }
  }
}

# Who may pass IAP: on the console's backend service once its name is known
# (console_backend_service), else on the project's IAP-protected web backends. Both wait for the
# IAP API (services.tf enables iap.googleapis.com with console_enabled): on a first apply the
# grant would otherwise race the API's enabling and fail.
resource "google_iap_web_backend_service_iam_member" "console_users" {
  for_each = var.console_enabled && var.console_backend_service != "" ? toset(var.console_users) : toset([])

  project             = var.project_id
  web_backend_service = var.console_backend_service
  role                = "roles/iap.httpsResourceAccessor"
  member              = each.value
  depends_on          = [google_project_service.enabled]
}

resource "google_iap_web_iam_member" "console_users" {
  for_each = var.console_enabled && var.console_backend_service == "" ? toset(var.console_users) : toset([])

  project    = var.project_id
  role       = "roles/iap.httpsResourceAccessor"
  member     = each.value
  depends_on = [google_project_service.enabled]
}
