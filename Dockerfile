# syntax=docker/dockerfile:1
# onceproxy: static binary on a distroless, non-root base.
#
#   docker build -t onceproxy .
#   docker run --rm -p 127.0.0.1:8080:8080 -p 127.0.0.1:1080:1080 -p 127.0.0.1:9090:9090 \
#     -v onceproxy-certs:/app/certs onceproxy
#
# The CA is generated into the certs volume on first start (key mode 0600,
# owned by the non-root user); fetch ca.pem from http://127.0.0.1:9090/ca.pem.

FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/onceproxy . \
 && mkdir -p /out/certs && cp certs/README.md /out/certs/

FROM gcr.io/distroless/static-debian12:nonroot
WORKDIR /app
COPY --from=build /out/onceproxy /app/onceproxy
COPY --from=build /src/config.yaml /app/config.yaml
# The CA directory must be writable by the non-root user (uid 65532).
COPY --from=build --chown=65532:65532 /out/certs /app/certs
VOLUME ["/app/certs"]
# Inside the container the listeners must bind all interfaces to be
# published. Without auth.users (and, for the admin port, a token) that is
# refused unless allowed explicitly: the image allows it because the ports
# are meant to be published on the host's loopback (see above). Configure
# users (ONCEPROXY_AUTH_USERS) and an admin token (ONCEPROXY_ADMIN_TOKEN_ENV
# naming a variable that holds it) and drop
# ONCEPROXY_AUTH_ALLOW_UNAUTHENTICATED before publishing them wider.
# Inside a container "this machine" is the container: no loopback targets.
ENV ONCEPROXY_PROXY_LISTEN=0.0.0.0:8080 \
    ONCEPROXY_SOCKS5_LISTEN=0.0.0.0:1080 \
    ONCEPROXY_ADMIN_LISTEN=0.0.0.0:9090 \
    ONCEPROXY_AUTH_ALLOW_UNAUTHENTICATED=true \
    ONCEPROXY_GUARD_ALLOW_CIDRS=[]
EXPOSE 8080 1080 9090
USER 65532:65532
ENTRYPOINT ["/app/onceproxy", "-config", "/app/config.yaml"]
