#!/usr/bin/env bash
# One-off TLS setup for the admission webhook, for clusters without cert-manager.
# Makes a CA and a serving certificate for gpuplane-webhook.gpuplane-system.svc, stores the pair as the
# Secret gpuplane-webhook-tls, and writes the CA into both webhooks' caBundle.
# Needs openssl and kubectl (with rights on gpuplane-system and validatingwebhookconfigurations).
# Rerun it to rotate (the certificate is valid for DAYS days), then restart the webhook Deployment.
set -euo pipefail

NAMESPACE=${NAMESPACE:-gpuplane-system}
SERVICE=${SERVICE:-gpuplane-webhook}
DAYS=${DAYS:-365}
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT

openssl req -x509 -newkey rsa:2048 -nodes -days "$DAYS" -subj "/CN=gpuplane-webhook-ca" \
  -keyout "$DIR/ca.key" -out "$DIR/ca.crt"
openssl req -newkey rsa:2048 -nodes -subj "/CN=$SERVICE.$NAMESPACE.svc" \
  -keyout "$DIR/tls.key" -out "$DIR/tls.csr"
printf 'subjectAltName=DNS:%s,DNS:%s.%s,DNS:%s.%s.svc,DNS:%s.%s.svc.cluster.local\nextendedKeyUsage=serverAuth\n' \
  "$SERVICE" "$SERVICE" "$NAMESPACE" "$SERVICE" "$NAMESPACE" "$SERVICE" "$NAMESPACE" > "$DIR/ext.cnf"
openssl x509 -req -in "$DIR/tls.csr" -CA "$DIR/ca.crt" -CAkey "$DIR/ca.key" -CAcreateserial \
  -days "$DAYS" -extfile "$DIR/ext.cnf" -out "$DIR/tls.crt"

kubectl -n "$NAMESPACE" create secret tls "$SERVICE-tls" --cert "$DIR/tls.crt" --key "$DIR/tls.key" \
  --dry-run=client -o yaml | kubectl apply -f -

CA=$(base64 < "$DIR/ca.crt" | tr -d '\n')
kubectl patch validatingwebhookconfiguration gpuplane-webhook --type json -p "[
  {\"op\": \"replace\", \"path\": \"/webhooks/0/clientConfig/caBundle\", \"value\": \"$CA\"},
  {\"op\": \"replace\", \"path\": \"/webhooks/1/clientConfig/caBundle\", \"value\": \"$CA\"}]"
echo "webhook TLS ready: secret $NAMESPACE/$SERVICE-tls, caBundle set"
