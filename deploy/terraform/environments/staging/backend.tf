# The staging state, in its own bucket and prefix: an apply here never reads or writes another
# environment's. The state holds no password (every workload uses IAM database authentication),
# but it holds the streams file and the whole inventory: keep the bucket access-controlled, with
# object versioning on (a bad apply can be rolled back to the previous state version).
terraform {
  backend "gcs" {
    bucket = "my-project-staging-tfstate"
    prefix = "pubsub-outbox/staging"
  }
}
