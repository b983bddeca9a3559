# Customer-managed encryption (var.kms_key_name): each service that encrypts with the key does so
# as its service agent, which must hold roles/cloudkms.cryptoKeyEncrypterDecrypter on the key
# before the topic, the instance or the repository is created with it (else the creation fails).
# The Cloud SQL agent does not exist until something creates it, so google_project_service_identity
# makes each agent (a no-op when it exists) and gives its email; the topics, the instance and the
# repository depend on the grants.

locals {
  cmek_services = var.kms_key_name == null ? [] : concat(
    ["pubsub.googleapis.com", "sqladmin.googleapis.com"],
    # Only a repository created here takes the key (create_artifact_registry_repository).
    var.create_artifact_registry_repository ? ["artifactregistry.googleapis.com"] : [],
  )
}

resource "google_project_service_identity" "cmek" {
  # In google-beta only (versions.tf).
  provider = google-beta
  for_each = toset(local.cmek_services)

  project    = var.project_id
  service    = each.value
  depends_on = [google_project_service.enabled]
}

resource "google_kms_crypto_key_iam_member" "service_agents" {
  for_each = google_project_service_identity.cmek

  crypto_key_id = var.kms_key_name
  role          = "roles/cloudkms.cryptoKeyEncrypterDecrypter"
  member        = each.value.member
}
